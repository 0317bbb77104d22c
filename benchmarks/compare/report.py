"""The comparison's outputs: rows from the runs, the verdict rule, the markdown tables, the plots.

Pure presentation: nothing here trains or simulates. A row is a dict (see
:func:`summarise`); ``compare.json`` holds the rows as they are.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

HEADER = (
    "| method | sync/async | sim bubble (p=4, profiled) | sim samples/s (p=4, profiled) | measured samples/s | "
    "weight versions / stage (sim) | peak activations / rank (sim, μb) | train loss | val loss | val accuracy | "
    "samples to target | verdict |"
)
MEMORY_HEADER = (
    "| method | weights / rank (measured) | extra weight versions / rank (measured) | activations / rank "
    "| sim p=4: weights | sim p=4: extra versions | sim p=4: activations |"
)


def samples_to_target(curve: list[list[float]], target: float, smooth: int = 5) -> int | None:
    """The samples seen when the loss, averaged over the last ``smooth`` mini-batches, first reaches ``target``."""
    for k in range(smooth, len(curve) + 1):
        if statistics.fmean(c[2] for c in curve[k - smooth : k]) <= target:
            return int(curve[k - 1][0])
    return None


def mean_sd(values: list[float]) -> tuple[float, float]:
    """Mean and standard deviation over seeds; NaN for both when a seed's value is not finite (it diverged)."""
    if not all(math.isfinite(v) for v in values):
        return math.nan, math.nan
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def loss_verdict(mean: float, sd: float, sync_mean: float, sync_sd: float) -> str:
    """Compare a row's validation loss (mean and sd over seeds) with the synchronous rows', counting the spread.

    ``sync_sd`` is the synchronous rows' typical seed spread. "Worse"/"better"
    when the gap exceeds the larger of 5 % of the synchronous mean and twice
    the combined spread, sqrt(sd^2 + sync_sd^2). Within that, "as synchronous"
    only when the row's own spread is no wider than the synchronous rows'
    (plus 5 % of their mean); a row whose seeds scatter more is "unclear",
    never "as synchronous" (the first rule widened its tolerance with the
    row's spread, so the noisiest rows were the surest matches).
    """
    if math.isnan(mean):
        return "diverged (a non-finite loss on some seed)"
    gap = mean - sync_mean
    if math.isnan(gap):
        return "no synchronous row to compare the loss with"
    tolerance = max(0.05 * sync_mean, 2 * math.hypot(sd, sync_sd))
    if gap > tolerance:
        return f"converges worse (val loss +{gap:.3f} vs the sync mean)"
    if gap < -tolerance:
        return f"converges better (val loss {gap:.3f} vs the sync mean)"
    if sd <= sync_sd + 0.05 * sync_mean:
        return "loss as synchronous training"
    return f"loss unclear: seeds spread ±{sd:.3f} (sync ±{sync_sd:.3f}), {gap:+.3f} vs the sync mean"


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
    parts.append(loss_verdict(*row["val_loss"], sync_val, sync_sd))
    return "; ".join(parts)


def summarise(
    methods: list[Any], runs: dict[str, list[dict[str, Any]]], sims: dict[str, Any], target: float
) -> list[dict[str, Any]]:
    """One row per method: simulated columns, seed means ± sd, memory, samples to target, the verdict."""
    rows = []
    for method in methods:
        seeds = runs[method.name]
        reached = [s for s in (samples_to_target(r["curve"], target) for r in seeds) if s is not None]
        sim = sims[method.name]
        rows.append(
            {
                "method": method.name,
                "family": method.family,
                "sim_bubble": sim["bubble"],
                "sim_throughput": sim["throughput"],
                "versions": sim["versions"],
                "activations": sim["activations"],
                "sim_memory": sim["memory"],
                "memory": seeds[0]["memory"],
                "samples_per_s": mean_sd([r["samples_per_s"] for r in seeds]),
                "train_loss": mean_sd([r["train_loss"] for r in seeds]),
                "val_loss": mean_sd([r["val_loss"] for r in seeds]),
                "val_accuracy": mean_sd([r["val_accuracy"] for r in seeds]),
                "samples_to_target": statistics.fmean(reached) if reached else None,
                "seeds_reaching_target": len(reached),
                "runs": seeds,
            }
        )
    # the reference: the synchronous rows that train exactly as one process (not, e.g., HetPipe's D = 0)
    refs = [r for r, m in zip(rows, methods, strict=True) if r["family"] == "sync" and getattr(m, "reference", True)]
    sync_vals = [x["val_loss"] for r in refs for x in r["runs"] if math.isfinite(x["val_loss"])]
    sync_sds = [r["val_loss"][1] for r in refs if math.isfinite(r["val_loss"][1])]
    sync_val = statistics.fmean(sync_vals) if sync_vals else math.nan  # no sync row: no comparison
    sync_sd = statistics.fmean(sync_sds) if sync_sds else 0.0
    for row in rows:
        row["verdict"] = verdict(row, sync_val, sync_sd)
    return rows


def _fmt(pair: tuple[float, float] | list[float], digits: int = 3) -> str:
    return f"{pair[0]:.{digits}f} ± {pair[1]:.{digits}f}"


def _kib(values: list[float]) -> str:
    return " / ".join(f"{v / 1024:.0f}" for v in values)


def markdown(rows: list[dict[str, Any]], header: str) -> str:
    """The main table and the memory table under ``header`` (the run's configuration, one paragraph)."""
    lines = [header, "", HEADER, "|---|---|---:|---:|---:|---|---|---:|---:|---:|---:|---|"]
    for r in rows:
        reach = "not reached" if r["samples_to_target"] is None else f"{r['samples_to_target']:.0f}"
        if r["samples_to_target"] is not None and r["seeds_reaching_target"] < len(r["runs"]):
            reach += f" ({r['seeds_reaching_target']}/{len(r['runs'])} seeds)"
        lines.append(
            f"| {r['method']} | {r['family']} | {r['sim_bubble']:.1%} | {r['sim_throughput']:.0f} | "
            f"{_fmt(r['samples_per_s'], 0)} | {'/'.join(str(v) for v in r['versions'])} | "
            f"{'/'.join(f'{a:g}' for a in r['activations'])} | {_fmt(r['train_loss'])} | {_fmt(r['val_loss'])} | "
            f"{_fmt(r['val_accuracy'])} | {reach} | {r['verdict']} |"
        )
    lines += [
        "",
        "Peak memory per rank in KiB (rank 0 / rank 1 / ...), first seed. Measured columns on the ranks this ran "
        "on: weights = the parameters the rank holds; extra weight versions = the most snapshots the runtime's "
        "version store held beyond the live weights (asynchronous rows; 0 for synchronous ones); activations = "
        "the runtime's activation meter (`measure_memory=True`, bytes saved for backward alive at once, max over "
        "steps) for synchronous rows, **simulated** from the profiled per-layer bytes for asynchronous rows (the "
        "meter does not run inside asynchronous windows). The sim p=4 columns are the simulator's, on the "
        "profiled 4-stage partition.",
        "",
        MEMORY_HEADER,
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        mem, sim = r["memory"], r["sim_memory"]
        act = _kib(mem["activations"]) + f" ({mem['activations_source']})"
        lines.append(
            f"| {r['method']} | {_kib(mem['weights'])} | {_kib(mem['versions'])} | {act} | "
            f"{_kib(sim['weights'])} | {_kib(sim['versions'])} | {_kib(sim['activations'])} |"
        )
    return "\n".join(lines) + "\n"


def plots(rows: list[dict[str, Any]], out: Path, title: str) -> None:
    """Loss vs samples (mean over seeds) and loss vs wall-clock (first seed), one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for name, xlabel, pick in (
        ("loss_vs_samples.png", "samples", lambda run: [c[0] for c in run["curve"]]),
        ("loss_vs_time.png", "wall-clock seconds (first seed)", lambda run: [c[1] for c in run["curve"]]),
    ):
        fig, ax = plt.subplots(figsize=(7, 4.2))
        for r in rows:
            runs = r["runs"] if name == "loss_vs_samples.png" else r["runs"][:1]
            ys = [statistics.fmean(run["curve"][k][2] for run in runs) for k in range(len(runs[0]["curve"]))]
            ax.plot(pick(runs[0]), ys, label=r["method"], linestyle="-" if r["family"] == "sync" else "--", lw=1)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("training loss (per mini-batch)")
        ax.set_yscale("log")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=6)
        fig.tight_layout()
        fig.savefig(out / name, dpi=90)
        plt.close(fig)
