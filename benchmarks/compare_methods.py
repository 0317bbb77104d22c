"""The seeds' comparison, measured: every pipeline method trains the same model on the same samples.

    make compare                                      # 2 ranks, both workloads, 3 seeds, writes out/compare/
    stagewise compare --workload cnn --steps 48 --seeds 0 1 2 --out out/compare
    stagewise run -n 2 benchmarks/compare_methods.py -- --workload gpt cnn --out out/compare

Workloads (:mod:`_compare_workloads`): the demo's stdlib-source GPT (tiny,
untied head), the digits CNN (loss and accuracy), and the first comparison's
MLP. For each, every method gets the same initial weights
(``Pipeline(seed=...)``), the same mini-batches in the same order, the same
optimizer (SGD, momentum 0.9, which XPipe's prediction needs) and the same
number of samples; a mini-batch is ``--microbatches`` micro-batches and one
optimizer update per stage. Synchronous methods run ``train_step`` per
mini-batch (a flush each); asynchronous ones ``train_stream`` in windows of
``--window`` mini-batches.

**Adding method rows from another module.** Rows are :class:`Method` specs
in :data:`METHODS`. Another module (importable from ``benchmarks/``) adds
rows by defining ``COMPARE_METHODS: list[Method]`` and being named in
:data:`EXTRA_METHOD_MODULES` (or on the command line, ``--extra-methods
MODULE``). A spec with ``run=None`` is trained by the default loop above on
``method.build(p, m, window)``; a spec with ``run`` set (e.g. HetPipe's
virtual workers) is trained by ``run(method, ctx, seed)``, called on every
rank at once (a collective), which must return the record described in
:func:`train_default`. ``build`` is also what the simulated columns simulate
at p = 4 unless ``simulate`` is given (same return shape as
:func:`_compare_costs.simulated`).

Columns, per workload: simulated bubble and throughput at p = 4 from the
**profiled** per-layer costs (:mod:`_compare_costs`); measured samples/s on
the ranks this runs on (training loop only, slowest rank); losses and
accuracy after training, mean ± sd over seeds; samples to the target loss;
a verdict by a fixed rule (:func:`_compare_report.verdict`, which counts the
seed spread); memory per rank (:func:`_compare_report.markdown` says which
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
import importlib
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
if __name__ == "__main__":  # method modules import this one by name: let them find it, not a second copy
    sys.modules.setdefault("compare_methods", sys.modules[__name__])

import stagewise as sw  # noqa: E402
from _compare_costs import SIM_RANKS, profile_costs, simulated, simulated_activation_bytes  # noqa: E402
from _compare_report import HEADER, markdown, plots, summarise, timeline_grid  # noqa: E402
from _compare_workloads import WORKLOADS, Workload, load_digits, minibatches, mlp_layers, workload  # noqa: E402

__all__ = ["HEADER", "METHODS", "SIM_RANKS", "Method", "load_digits", "minibatches", "mlp_layers"]


@dataclass
class RunContext:
    """What a method's trainer gets besides its seed: the workload, the options, this rank, the profiled costs."""

    workload: Workload
    args: argparse.Namespace
    rank: int
    world_size: int
    profiled: dict[str, Any]
    keep_timeline: bool  # gather a timeline of the last step/window (first seed only)
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Method:
    """One row: a name, its family ("sync" or "async"), how to build its schedule for p ranks, m micro-batches
    and a window of n mini-batches, and optionally its own trainer and simulation (see the module docstring)."""

    name: str
    family: str
    build: Callable[[int, int, int], sw.Schedule]
    run: Callable[[Method, RunContext, int], dict[str, Any]] | None = None
    simulate: Callable[[Method, RunContext], dict[str, Any]] | None = None
    reference: bool = True  # a "sync" row that trains as one process does: the verdicts' reference


def _sync(name: str, virtual: int | None = None) -> Callable[[int, int, int], sw.Schedule]:
    return lambda p, m, n: sw.build_schedule(name, p, m, virtual)


def _async(name: str, **options: bool) -> Callable[[int, int, int], sw.Schedule]:
    return lambda p, m, n: sw.async_schedule(name, p, n, m, **options)


METHODS: list[Method] = [
    Method("gpipe", "sync", _sync("gpipe")),
    Method("1f1b", "sync", _sync("1f1b")),
    Method("zb-h1", "sync", _sync("zb-h1")),
    Method("interleaved-1f1b", "sync", _sync("interleaved-1f1b", 2)),
    Method("pipedream (stashing)", "async", _async("pipedream")),
    Method("pipedream (stashing + vertical sync)", "async", _async("pipedream", vertical_sync=True)),
    Method("pipedream (no stashing)", "async", _async("pipedream", stashing=False)),
    Method("pipedream-2bw", "async", _async("pipedream-2bw")),
    Method("xpipe", "async", _async("xpipe")),
]

#: modules (importable from benchmarks/) whose ``COMPARE_METHODS`` rows are appended to METHODS
EXTRA_METHOD_MODULES: tuple[str, ...] = ("_compare_hetpipe",)


def all_methods(extra: list[str] | None = None) -> list[Method]:
    """METHODS, then the rows of every module in EXTRA_METHOD_MODULES and ``extra``, in that order."""
    out = list(METHODS)
    for name in (*EXTRA_METHOD_MODULES, *(extra or [])):
        rows = getattr(importlib.import_module(name), "COMPARE_METHODS", None)
        if not isinstance(rows, list) or not all(isinstance(r, Method) for r in rows):
            raise ValueError(f"method module {name!r} must define COMPARE_METHODS: list[Method]")
        out += rows
    names = [m.name for m in out]
    if len(set(names)) != len(names):
        raise ValueError(f"method names must be unique, got {names}")
    return out


def _param_bytes(params: Any) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def _measured_memory(pipe: sw.Pipeline, method: Method, ctx: RunContext, schedule: sw.Schedule, act_peak: int) -> Any:
    """This rank's weights, extra weight versions (the async version store's peak snapshots) and activations."""
    weights = _param_bytes(pipe.parameters())
    versions = 0
    trainer = pipe.__dict__.get("_async_trainer")
    if trainer is not None:
        store = trainer.interpreter.versions
        versions = sum(v.peak * _param_bytes(v.stage.params) for v in store.values())
    gathered: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(gathered, (weights, versions, act_peak))
    memory = {k: [g[i] for g in gathered] for i, k in enumerate(("weights", "versions", "activations"))}
    memory["activations_source"] = "measured"
    if method.family == "async":
        memory["activations"] = simulated_activation_bytes(schedule, ctx.workload.layers(), ctx.profiled)
        memory["activations_source"] = "sim"
    return memory


def train_default(method: Method, ctx: RunContext, seed: int) -> dict[str, Any]:
    """Train one method with one seed; every rank returns the same record.

    The record: ``curve`` [(samples, seconds, loss) per mini-batch], ``samples_per_s``, ``train_loss``,
    ``val_loss``, ``val_accuracy``, ``memory`` ({weights, versions, activations: bytes per rank,
    activations_source}), ``timeline`` (an ``sw.Timeline`` or None; rank 0 draws it).
    """
    args, wl = ctx.args, ctx.workload
    batches = wl.train(args.steps, args.batch, seed)
    schedule = method.build(ctx.world_size, args.microbatches, args.window)
    pipe = sw.Pipeline(
        wl.layers(),
        loss_fn=wl.loss_fn,
        schedule=schedule,
        optimizer=lambda params: torch.optim.SGD(params, lr=args.lr, momentum=0.9),
        seed=seed,
        measure_memory=method.family == "sync",
    )
    curve: list[tuple[int, float, float]] = []
    act_peak = 0
    dist.barrier()
    t0 = time.perf_counter()
    if method.family == "sync":
        for k, (x, y) in enumerate(batches, start=1):
            loss = pipe.train_step(x, y)
            curve.append((k * args.batch, time.perf_counter() - t0, float(loss)))
            act_peak = max(act_peak, pipe.memory_report()["peak_bytes"])
    else:
        for k, loss in enumerate(pipe.train_stream(batches), start=1):
            curve.append((k * args.batch, time.perf_counter() - t0, float(loss)))
    elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    timeline = pipe.timeline(gather=True) if ctx.keep_timeline else None
    memory = _measured_memory(pipe, method, ctx, schedule, act_peak)
    final: list[Any] = [None]
    reporter = pipe.schedule.placement[-1]
    results = {}
    for split, (x, y) in wl.eval_sets(args.microbatches).items():
        pipe.reset_shapes()
        logits = pipe.eval_step(x)
        if pipe.rank == reporter:
            results[f"{split}_loss"] = float(wl.loss_fn(logits, y))
            results[f"{split}_accuracy"] = wl.accuracy(logits, y)
    final[0] = results if pipe.rank == reporter else None
    dist.broadcast_object_list(final, src=reporter)
    rate = len(batches) * args.batch / elapsed.item()
    return {"seed": seed, "samples_per_s": rate, "curve": curve, "memory": memory, "timeline": timeline, **final[0]}


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
    measured, simulated_ = [], []
    for k, method in enumerate(methods):
        timeline = runs[method.name][0].get("timeline")
        if timeline is not None:
            path = out / f"_measured_{k}.png"
            measured.append(sw.render_png(timeline, path, title=f"{method.name}: measured, last step/window", dpi=55))
        result = sims[method.name].get("timeline")
        if result is not None:
            sim_tl = dataclasses.replace(result.timeline, unit="s")
            path = out / f"_simulated_{k}.png"
            simulated_.append(sw.render_png(sim_tl, path, title=f"{method.name}: simulated p=4, profiled", dpi=55))
    for pictures, name in ((measured, "timelines_measured.png"), (simulated_, "timelines_simulated.png")):
        if pictures:
            timeline_grid(pictures, out / name)


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
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(wargs).items()}
    data = {"config": config, "workload": name, "ranks": world, "profiled": profiled, "rows": rows}
    (out / "compare.json").write_text(json.dumps(data, indent=1))
    return text


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
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
