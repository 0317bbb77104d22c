"""The seeds' comparison, measured: every pipeline method trains the same model on the same samples.

    make compare                                      # 2 ranks, both workloads, 3 seeds, writes out/compare/
    stagewise compare --workload cnn --steps 48 --seeds 0 1 2 --out out/compare
    .venv/bin/python -m benchmarks.compare --ranks 2 --workload gpt cnn --out out/compare

Run as a module, it starts ``--ranks`` local ranks (torchrun) running
itself; under torchrun it is one of them. Workloads (:mod:`.workloads`): the
demo's stdlib-source GPT (tiny, untied head), the digits CNN (loss and
accuracy), and the first comparison's MLP. For each, every method gets the
same initial weights (``Pipeline(seed=...)``), the same mini-batches in the
same order, the same optimizer (SGD, momentum 0.9, which XPipe's prediction
needs) and the same number of samples; a mini-batch is ``--microbatches``
micro-batches and one optimizer update per stage. Synchronous methods run
``train_step`` per mini-batch (a flush each); asynchronous ones
``train_stream`` in windows of ``--window`` mini-batches. The rows are
:mod:`.methods` (which says how another module adds rows), trained by
:mod:`.train` unless a row brings its own trainer.

Columns, per workload: simulated bubble and throughput at p = 4 from the
**profiled** per-layer costs (:mod:`.costs`); measured samples/s on
the ranks this runs on (training loop only, slowest rank); losses and
accuracy after training, mean ± sd over seeds; samples to the target loss;
a verdict by a fixed rule (:func:`.report.loss_verdict`, which counts the
seed spread); memory per rank (:func:`.report.markdown` says which
column is measured and which simulated). Figures: loss vs samples, loss vs
time, and one timeline per method side by side (measured on these ranks,
the last step or window of the first seed; simulated at p = 4).

Rank 0 writes, under ``--out``/WORKLOAD: ``compare.md``, ``compare.json``,
``loss_vs_samples.png``, ``loss_vs_time.png``, ``timelines_measured.png``,
``timelines_simulated.png``; and ``--out``/``compare.md`` with every workload.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import stagewise as sw

from .._launch import launched, on_ranks
from .costs import SIM_RANKS, profile_costs, simulated
from .methods import Method, RunContext, all_methods
from .report import markdown, plots, summarise
from .train import train_default
from .workloads import WORKLOADS, Workload, workload


def _simulate(method: Method, ctx: RunContext) -> dict[str, Any]:
    if method.simulate is not None:
        return method.simulate(method, ctx)
    schedule = method.build(SIM_RANKS, ctx.args.microbatches, ctx.args.window)
    return simulated(schedule, method.family, ctx.profiled, ctx.args.batch / ctx.args.microbatches)


def _profile(wl: Workload, args: argparse.Namespace, rank: int) -> dict[str, Any]:
    """Rank 0 profiles (one micro-batch of the first mini-batch) while the others wait; all get the result."""
    box: list[Any] = [None]
    if rank == 0:
        x, _ = wl.train(1, args.batch, 0)[0]
        box[0] = profile_costs(wl.layers(), x[: args.batch // args.microbatches])
    dist.broadcast_object_list(box, src=0)
    return box[0]  # type: ignore[no-any-return]


def _draw_timelines(methods: list[Method], runs: dict[str, Any], sims: dict[str, Any], out: Path) -> None:
    """One panel per method, full width, each on its own time scale (a window of 32 micro-batches beside a step)."""
    measured, simulated_ = [], []
    for method in methods:
        timeline = runs[method.name][0].get("timeline")
        if timeline is not None:
            measured.append((timeline, f"{method.name}: measured, last step/window"))
        result = sims[method.name].get("timeline")
        if result is not None:
            simulated_.append(
                (dataclasses.replace(result.timeline, unit="s"), f"{method.name}: simulated p=4, profiled")
            )
    for panels, name in ((measured, "timelines_measured.png"), (simulated_, "timelines_simulated.png")):
        if panels:
            timelines, titles = zip(*panels)
            sw.render.render_stack(timelines, out / name, titles=titles, share_x=False, dpi=80)


def _header(wl: Workload, args: argparse.Namespace, world: int, profiled: dict[str, Any]) -> str:
    return (
        f"**{wl.name}**: {wl.description}. {args.steps} mini-batches of {args.batch} ({args.microbatches} "
        f"micro-batches) = {args.steps * args.batch} samples per run, {len(args.seeds)} seed(s) {args.seeds}, "
        f"{world} ranks measured; async window {args.window}; SGD lr {args.lr} momentum 0.9; target loss "
        f"{args.target_loss} (training loss smoothed over 5 mini-batches). Simulated columns: p = 4, per-stage "
        f"costs profiled on {profiled['device']} (`sw.profile`, one micro-batch; stage bounds {profiled['bounds']}, "
        "free transfers; interleaved: each stage cut into 2 equal chunks). ± is the standard deviation over seeds."
    )


def run_workload(name: str, methods: list[Method], args: argparse.Namespace, rank: int, world: int) -> str | None:
    """Every method, every seed on one workload; rank 0 writes its outputs and returns its markdown."""
    wl = workload(name)
    wargs = argparse.Namespace(**vars(args))
    wargs.batch = args.batch or wl.batch
    wargs.lr = args.lr if args.lr is not None else wl.lr
    wargs.target_loss = args.target_loss if args.target_loss is not None else wl.target_loss
    profiled = _profile(wl, wargs, rank)
    runs: dict[str, list[dict[str, Any]]] = {m.name: [] for m in methods}
    for s, seed in enumerate(args.seeds):  # seeds outermost, so a burst of load spreads over the methods alike
        for method in methods:
            ctx = RunContext(wl, wargs, rank, world, profiled, keep_timeline=s == 0 and not args.no_plots)
            record = (method.run or train_default)(method, ctx, seed)
            if rank == 0 and not all(math.isfinite(c[2]) for c in record["curve"]):
                print(f"warning: {name} {method.name} seed {seed}: non-finite loss")
            runs[method.name].append(record)
    ctx = RunContext(wl, wargs, rank, world, profiled, keep_timeline=False)
    sims = {m.name: _simulate(m, ctx) for m in methods}
    if rank != 0:
        return None
    out = args.out / name
    out.mkdir(parents=True, exist_ok=True)
    rows = summarise(methods, runs, sims, wargs.target_loss)
    text = markdown(rows, _header(wl, wargs, world, profiled))
    (out / "compare.md").write_text(text)
    if not args.no_plots:
        plots(rows, out, f"{name}: training loss, mean over seeds {args.seeds}")
        _draw_timelines(methods, runs, sims, out)
    for row in rows:
        for run in row["runs"]:
            run.pop("timeline", None)
    # --ranks only says how many ranks to start; "ranks" below is how many ran
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(wargs).items() if k != "ranks"}
    data = {"config": config, "workload": name, "ranks": world, "profiled": profiled, "rows": rows}
    (out / "compare.json").write_text(json.dumps(data, indent=1))
    return text


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.compare", description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2, help="ranks to start when run as a module (default 2)")
    parser.add_argument("--out", type=Path, default=Path("out/compare"))
    parser.add_argument("--workload", nargs="+", default=["gpt", "cnn"], choices=sorted(WORKLOADS))
    parser.add_argument("--steps", type=int, default=48, help="mini-batches per run (same for every method)")
    parser.add_argument("--batch", type=int, default=0, help="samples per mini-batch (default: the workload's)")
    parser.add_argument("--microbatches", type=int, default=4, help="micro-batches per mini-batch (>= p - 1 for 2BW)")
    parser.add_argument("--window", type=int, default=8, help="mini-batches per asynchronous window")
    parser.add_argument("--lr", type=float, default=None, help="SGD learning rate (default: the workload's)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--target-loss", type=float, default=None, help="default: the workload's")
    parser.add_argument("--methods", nargs="+", metavar="NAME", help="only these rows (default: all)")
    parser.add_argument("--extra-methods", nargs="+", metavar="MODULE", help="modules with COMPARE_METHODS rows")
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args(argv)
    for name in ("steps", "microbatches", "window"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}: must be >= 1, got {getattr(args, name)}")
    if args.steps % args.window:
        parser.error(f"--steps ({args.steps}) must be a multiple of --window ({args.window}): whole windows only")
    known = [m.name for m in all_methods(args.extra_methods)]
    unknown = sorted(set(args.methods or []) - set(known))
    if unknown:
        parser.error(f"--methods: unknown {unknown}; expected names among {known}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not launched():  # python -m benchmarks.compare: start the ranks, each running this module
        sys.exit(on_ranks(args.ranks, "benchmarks.compare", sys.argv[1:] if argv is None else argv))
    methods = [m for m in all_methods(args.extra_methods) if args.methods is None or m.name in args.methods]
    torch.set_num_threads(1)
    env = sw.init(backend="gloo")
    texts = [run_workload(name, methods, args, env.rank, env.world_size) for name in args.workload]
    if env.rank == 0:
        text = "\n".join(t for t in texts if t)
        (args.out / "compare.md").write_text(text)
        print(text)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
