"""The seeds' comparison, measured: every pipeline method trains the same model on the same samples.

    make compare                                      # 2 ranks, 3 seeds, writes out/compare/
    .venv/bin/stagewise run -n 2 benchmarks/compare_methods.py -- --out out/compare --seeds 3

Workload: an MLP (64-128-128-128-10, ReLU) on scikit-learn's bundled digits
(8x8 images flattened; 1,500 for training, 297 held out; no download; losses are
evaluated on the largest multiple of m of each: 1,500 and 296 at m = 4). Every
method gets the same initial weights (``Pipeline(seed=...)`` seeds each layer),
the same mini-batches in the same order, the same optimizer (SGD with
momentum, which XPipe's prediction needs) and the same number of samples; a
mini-batch is ``--microbatches`` micro-batches and one optimizer update per
stage. Synchronous methods run ``train_step`` per mini-batch (a flush each);
asynchronous ones ``train_stream`` in windows of ``--window`` mini-batches.

Methods are rows of :data:`METHODS` (a schedule builder and its family); the
runner has no per-method branch beyond sync (``train_step``) vs async
(``train_stream``). Columns:

* simulated bubble and throughput (micro-batches per unit time) at p = 4 with
  **uniform** per-stage costs (F = 1, B = I + W = 2 per stage, free transfers;
  interleaved stages cost 1/v each), for one mini-batch (sync) or one window
  (async) — not profiled;
* weight versions per stage and peak activations per rank (micro-batches in
  flight) at p = 4: **simulated** (the version table and the simulator);
* measured samples/s on the ranks this runs on (training loop only, slowest rank);
* final training loss (the whole training set, evaluated after training) and
  validation loss / accuracy (held-out set): mean ± standard deviation over seeds;
* samples until the training loss, smoothed over 5 mini-batches, first reaches
  ``--target-loss`` (mean over the seeds that reach it);
* a one-line verdict derived from those numbers by a fixed rule (:func:`verdict`).

Rank 0 writes ``compare.md``, ``compare.json``, ``loss_vs_samples.png`` and
``loss_vs_time.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import stagewise as sw

SIM_RANKS = 4


@dataclass(frozen=True)
class Method:
    """One row: a name, its family, and how to build its schedule for p ranks, m micro-batches, a window of n."""

    name: str
    family: str  # "sync" or "async"
    build: Callable[[int, int, int], sw.Schedule]


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


def mlp_layers() -> list[sw.Layer]:
    widths = [64, 128, 128, 128]
    out: list[sw.Layer] = []
    for a, b in zip(widths, widths[1:], strict=False):
        out += [sw.Layer(nn.Linear, a, b), sw.Layer(nn.ReLU)]
    return out + [sw.Layer(nn.Linear, widths[-1], 10)]


def load_digits(test_size: int = 297) -> tuple[torch.Tensor, ...]:
    """(x_train, y_train, x_test, y_test), one fixed split (seed 0) for every method and seed; standardised."""
    from sklearn.datasets import load_digits as sklearn_digits

    digits = sklearn_digits()
    x = torch.tensor(digits.data, dtype=torch.float32)
    y = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    test, train = order[:test_size], order[test_size:]
    mean, std = x[train].mean(), x[train].std()
    x = (x - mean) / std
    return x[train], y[train], x[test], y[test]


def minibatches(x: torch.Tensor, y: torch.Tensor, count: int, size: int, seed: int) -> list[tuple[Any, Any]]:
    """``count`` mini-batches drawn epoch by epoch from a seeded permutation (last partial batch dropped)."""
    gen, order, out = torch.Generator().manual_seed(seed), torch.empty(0, dtype=torch.long), []
    for _ in range(count):
        if len(order) < size:
            order = torch.randperm(len(x), generator=gen)
        idx, order = order[:size], order[size:]
        out.append((x[idx], y[idx]))
    return out


def simulated(method: Method, m: int, window: int, samples_per_mb: float) -> dict[str, Any]:
    """Bubble, throughput (samples per unit time), versions and activations at p = SIM_RANKS, uniform costs."""
    schedule = method.build(SIM_RANKS, m, window)
    if not schedule.is_complete:
        schedule = sw.lower(schedule)
    v = schedule.num_stages // SIM_RANKS
    costs = sw.CostModel.uniform(
        schedule.num_stages, forward=1 / v, backward_input=1 / v, backward_weight=1 / v, parameter_bytes=1 / v
    )
    result = sw.simulate(schedule, costs)
    microbatches = schedule.num_microbatches
    if method.family == "async":
        versions = sw.async_report(schedule, result).peak_versions
    else:
        versions = [1] * SIM_RANKS
    return {
        "bubble": result.bubble_ratio,
        "throughput": microbatches * samples_per_mb / result.makespan,
        "versions": list(versions),
        "activations": list(result.peak_activations),
    }


def run_one(
    method: Method, args: argparse.Namespace, seed: int, data: tuple[torch.Tensor, ...], p: int
) -> dict[str, Any]:
    """Train one method with one seed; every rank returns the same record (losses broadcast from the last stage)."""
    x_train, y_train, x_test, y_test = data
    batches = minibatches(x_train, y_train, args.steps, args.batch, seed)
    pipe = sw.Pipeline(
        mlp_layers(),
        loss_fn=F.cross_entropy,
        schedule=method.build(p, args.microbatches, args.window),
        optimizer=lambda params: torch.optim.SGD(params, lr=args.lr, momentum=0.9),
        seed=seed,
    )
    curve: list[tuple[int, float, float]] = []  # (samples, seconds, loss)
    dist.barrier()
    t0 = time.perf_counter()
    losses = (pipe.train_step(x, y) for x, y in batches) if method.family == "sync" else pipe.train_stream(batches)
    for k, loss in enumerate(losses, start=1):
        curve.append((k * args.batch, time.perf_counter() - t0, float(loss)))
    elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    final: list[Any] = [None]
    m = args.microbatches  # evaluation shapes differ from training's: reset them, use whole micro-batches
    x_train, y_train = x_train[: len(x_train) // m * m], y_train[: len(y_train) // m * m]
    x_test, y_test = x_test[: len(x_test) // m * m], y_test[: len(y_test) // m * m]
    pipe.reset_shapes()
    train_logits = pipe.eval_step(x_train)
    pipe.reset_shapes()
    test_logits = pipe.eval_step(x_test)
    reporter = pipe.schedule.placement[-1]
    if pipe.rank == reporter:
        final[0] = {
            "train_loss": float(F.cross_entropy(train_logits, y_train)),
            "val_loss": float(F.cross_entropy(test_logits, y_test)),
            "val_accuracy": float((test_logits.argmax(1) == y_test).float().mean()),
        }
    dist.broadcast_object_list(final, src=reporter)
    return {"seed": seed, "samples_per_s": len(batches) * args.batch / elapsed.item(), "curve": curve, **final[0]}


def samples_to_target(curve: list[list[float]], target: float, smooth: int = 5) -> int | None:
    """The samples seen when the loss, averaged over the last ``smooth`` mini-batches, first reaches ``target``."""
    for k in range(smooth, len(curve) + 1):
        if statistics.fmean(c[2] for c in curve[k - smooth : k]) <= target:
            return int(curve[k - 1][0])
    return None


def _mean_sd(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def verdict(row: dict[str, Any], sync_val: float, sync_sd: float) -> str:
    """The seeds' kind of one-liner, from fixed thresholds on the row's numbers (not written by hand per method)."""
    parts = []
    if row["sim_bubble"] > 0.2:
        parts.append(f"lots of bubbles ({row['sim_bubble']:.0%} simulated)")
    elif row["sim_bubble"] < 0.1:
        parts.append(f"few bubbles ({row['sim_bubble']:.0%})")
    else:
        parts.append(f"some bubbles ({row['sim_bubble']:.0%})")
    most = max(row["versions"])
    if most > 2:
        parts.append(f"redundant weight versions (up to {most})")
    elif most == 2:
        parts.append("two weight versions")
    gap = row["val_loss"][0] - sync_val
    tolerance = max(0.05 * sync_val, 2 * max(sync_sd, row["val_loss"][1]))
    if math.isnan(gap):
        parts.append("no synchronous row to compare the loss with")
    elif gap > tolerance:
        parts.append(f"converges worse (val loss +{gap:.3f} vs the sync mean)")
    elif gap < -tolerance:
        parts.append(f"converges better (val loss {gap:.3f} vs the sync mean)")
    else:
        parts.append("loss as synchronous training")
    return "; ".join(parts)


def summarise(
    methods: list[Method], runs: dict[str, list[dict[str, Any]]], sims: dict[str, Any], args: argparse.Namespace
) -> list[dict[str, Any]]:
    """One row per method: simulated columns, seed means ± sd, samples to target, the verdict."""
    rows = []
    for method in methods:
        seeds = runs[method.name]
        reach = [samples_to_target(r["curve"], args.target_loss) for r in seeds]
        reached = [s for s in reach if s is not None]
        rows.append(
            {
                "method": method.name,
                "family": method.family,
                "sim_bubble": sims[method.name]["bubble"],
                "sim_throughput": sims[method.name]["throughput"],
                "versions": sims[method.name]["versions"],
                "activations": sims[method.name]["activations"],
                "samples_per_s": _mean_sd([r["samples_per_s"] for r in seeds]),
                "train_loss": _mean_sd([r["train_loss"] for r in seeds]),
                "val_loss": _mean_sd([r["val_loss"] for r in seeds]),
                "val_accuracy": _mean_sd([r["val_accuracy"] for r in seeds]),
                "samples_to_target": statistics.fmean(reached) if reached else None,
                "seeds_reaching_target": len(reached),
                "runs": seeds,
            }
        )
    sync_vals = [x["val_loss"] for r in rows if r["family"] == "sync" for x in r["runs"]]
    sync_val, sync_sd = _mean_sd(sync_vals) if sync_vals else (math.nan, 0.0)  # no sync row: no comparison
    for row in rows:
        row["verdict"] = verdict(row, sync_val, sync_sd)
    return rows


def _fmt(pair: tuple[float, float], digits: int = 3) -> str:
    return f"{pair[0]:.{digits}f} ± {pair[1]:.{digits}f}"


HEADER = (
    "| method | sync/async | sim bubble (p=4) | sim samples / unit (p=4) | measured samples/s | "
    "weight versions / stage (sim) | peak activations / rank (sim, μb) | train loss | val loss | val accuracy | "
    "samples to target | verdict |"
)


def markdown(rows: list[dict[str, Any]], args: argparse.Namespace, p: int) -> str:
    lines = [
        f"{args.steps} mini-batches of {args.batch} ({args.microbatches} micro-batches) = "
        f"{args.steps * args.batch} samples per run, {len(args.seeds)} seed(s) {args.seeds}, {p} ranks measured; "
        f"async window {args.window}; SGD lr {args.lr} momentum 0.9; target loss {args.target_loss} "
        "(training loss smoothed over 5 mini-batches). Simulated columns: p = 4, uniform costs. ± is the standard "
        "deviation over seeds.",
        "",
        HEADER,
        "|---|---|---:|---:|---:|---|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        reach = "not reached" if r["samples_to_target"] is None else f"{r['samples_to_target']:.0f}"
        if r["samples_to_target"] is not None and r["seeds_reaching_target"] < len(r["runs"]):
            reach += f" ({r['seeds_reaching_target']}/{len(r['runs'])} seeds)"
        lines.append(
            f"| {r['method']} | {r['family']} | {r['sim_bubble']:.1%} | {r['sim_throughput']:.2f} | "
            f"{_fmt(r['samples_per_s'], 0)} | {'/'.join(str(v) for v in r['versions'])} | "
            f"{'/'.join(f'{a:g}' for a in r['activations'])} | {_fmt(r['train_loss'])} | {_fmt(r['val_loss'])} | "
            f"{_fmt(r['val_accuracy'])} | {reach} | {r['verdict']} |"
        )
    return "\n".join(lines) + "\n"


def plots(rows: list[dict[str, Any]], out: Path) -> None:
    """Loss vs samples (mean over seeds) and loss vs wall-clock (first seed), one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for name, xlabel, pick in (
        ("loss_vs_samples.png", "samples", lambda run: [c[0] for c in run["curve"]]),
        ("loss_vs_time.png", "wall-clock seconds (first seed)", lambda run: [c[1] for c in run["curve"]]),
    ):
        fig, ax = plt.subplots(figsize=(8, 5))
        for r in rows:
            runs = r["runs"] if name == "loss_vs_samples.png" else r["runs"][:1]
            ys = [statistics.fmean(run["curve"][k][2] for run in runs) for k in range(len(runs[0]["curve"]))]
            ax.plot(pick(runs[0]), ys, label=r["method"], linestyle="-" if r["family"] == "sync" else "--")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("training loss (per mini-batch)")
        ax.set_yscale("log")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("out/compare"))
    parser.add_argument("--steps", type=int, default=96, help="mini-batches per run (same for every method)")
    parser.add_argument("--batch", type=int, default=64, help="samples per mini-batch")
    parser.add_argument("--microbatches", type=int, default=4, help="micro-batches per mini-batch (>= p - 1 for 2BW)")
    parser.add_argument("--window", type=int, default=8, help="mini-batches per asynchronous window")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--target-loss", type=float, default=0.3)
    parser.add_argument("--methods", nargs="+", metavar="NAME", help="only these rows of METHODS (default: all)")
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args(argv)
    methods = [m for m in METHODS if args.methods is None or m.name in args.methods]
    unknown = sorted(set(args.methods or []) - {m.name for m in METHODS})
    if unknown:
        parser.error(f"--methods: unknown {unknown}; expected names among {[m.name for m in METHODS]}")
    torch.set_num_threads(1)
    env = sw.init(backend="gloo")
    data = load_digits()
    runs: dict[str, list[dict[str, Any]]] = {m.name: [] for m in methods}
    for seed in args.seeds:  # seeds outermost, so a burst of load spreads over the methods alike
        for method in methods:
            record = run_one(method, args, seed, data, env.world_size)
            bad = [c for c in record["curve"] if not math.isfinite(c[2])]
            if bad and env.rank == 0:
                print(f"warning: {method.name} seed {seed}: non-finite loss at {bad[0][0]} samples")
            runs[method.name].append(record)
    sims = {m.name: simulated(m, args.microbatches, args.window, args.batch / args.microbatches) for m in methods}
    if env.rank == 0:
        rows = summarise(methods, runs, sims, args)
        args.out.mkdir(parents=True, exist_ok=True)
        text = markdown(rows, args, env.world_size)
        (args.out / "compare.md").write_text(text)
        config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        (args.out / "compare.json").write_text(
            json.dumps({"config": config, "ranks": env.world_size, "rows": rows}, indent=1)
        )
        if not args.no_plots:
            plots(rows, args.out)
        print(text)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
