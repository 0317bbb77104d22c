"""The synthesizer on the issue's suite: against the best hand-written schedule that fits, ZB-H1, the bound.

    .venv/bin/python -m benchmarks.synthesis [--ranks 4 8] [--microbatches 8 16 32] [--curve] [--pictures]

For every cost model of :data:`.suite.SUITE`, p ranks, m micro-batches and a cap of 1F1B's memory
(min(p, m) micro-batches on every rank, W's stash counted) and twice it, one row: the best registered
schedule that fits the cap (as it runs: 1F1B with B, timed at B's measured cost), ZB-H1, the synthesized
schedule, the lower bound, and the seconds synthesis took. The measured profiles are charged I, W and B
as measured (``benchmarks.synthesis.backward`` shows what that changes on one GPT). Then the issue's
targets, met or not, with their numbers. ``--curve``: synthesis time for p in {4, 8, 16} and m in
{8, 16, 32, 64}. ``--pictures``: docs/synthesis-*.png.
Simulated makespans, in the cost model's units (block-forwards, or seconds for the measured profiles).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass, replace

from stagewise.schedules import generate
from stagewise.simulation import CostModel, simulate
from stagewise.synthesis import report_of, synthesize

from . import suite
from .suite import SUITE, uniform


@dataclass(frozen=True)
class Row:
    case: str
    p: int
    m: int
    cap: int  # micro-batches on every rank
    factor: int  # 1: 1F1B's memory, 2: twice it
    baseline: str
    baseline_ms: float
    zb_h1: float | None  # None: over the cap
    auto: float
    bound: float
    seconds: float


def micro_batch_peaks(schedule_name: str, costs: CostModel, p: int, m: int) -> float:
    """The most activations (micro-batches, W's part counted) a rank of a registered schedule holds."""
    units = replace(
        costs,
        activation_bytes=(1.0,) * p,
        weight_activation_bytes=tuple(  # W's stash, as a share of the activations (it may be more than them)
            k / a if a > 0 else 0.0 for k, a in zip(costs.weight_activation_bytes, costs.activation_bytes)
        ),
    )
    return max(simulate(generate(schedule_name, p, m), units).peak_activation_bytes)


def row(case: str, costs: CostModel, p: int, m: int, factor: int) -> Row:
    cap = factor * min(p, m)
    start = time.perf_counter()
    got = synthesize(costs, p, m, memory=cap)
    seconds = time.perf_counter() - start
    rep = report_of(got)
    h1 = simulate(generate("zb-h1", p, m), costs).makespan
    fits = micro_batch_peaks("zb-h1", costs, p, m) <= cap + 1e-9
    return Row(case, p, m, cap, factor, rep.baseline, rep.baseline_makespan, h1 if fits else None, rep.makespan,
               rep.lower_bound, seconds)  # fmt: skip


def table(rows: list[Row]) -> str:
    out = [
        "| cost model | p | m | cap | best hand-written that fits | ZB-H1 | synthesized | vs best | vs ZB-H1 "
        "| bound | above bound | s |",
        "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        h1 = "over cap" if r.zb_h1 is None else f"{r.zb_h1:.4g}"
        vs_h1 = "" if r.zb_h1 is None else f"{(r.auto / r.zb_h1 - 1) * 100:+.1f}%"
        out.append(
            f"| {r.case} | {r.p} | {r.m} | {r.cap} ({r.factor}x) | {r.baseline} {r.baseline_ms:.4g} | {h1} "
            f"| {r.auto:.4g} | {(r.auto / r.baseline_ms - 1) * 100:+.1f}% | {vs_h1} | {r.bound:.4g} "
            f"| {(r.auto / r.bound - 1) * 100:.1f}% | {r.seconds:.2f} |"
        )
    return "\n".join(out)


def targets(rows: list[Row]) -> str:
    """The issue's targets on the suite, each with its numbers."""
    slower = [r for r in rows if r.auto > r.baseline_ms * (1 + 1e-12)]
    tight = [r for r in rows if r.factor == 1 and r.zb_h1 is not None and ("latency" in r.case or "I:W" in r.case)]
    met = [r for r in tight if r.auto <= 0.95 * r.zb_h1]  # type: ignore[operator]
    gains = [1 - r.auto / r.zb_h1 for r in tight]  # type: ignore[operator]
    loose = [r.auto / r.bound - 1 for r in rows if r.factor == 2]
    big = [r.seconds for r in rows if r.p == 8 and r.m == 32]
    lines = [
        f"- never slower than the best hand-written schedule that fits: {len(rows) - len(slower)} of {len(rows)} rows"
        + (f" (slower: {', '.join(f'{r.case} p{r.p} m{r.m}' for r in slower)})" if slower else ""),
        f"- 1F1B's memory, latency and I:W rows, at least 5 % below ZB-H1: {len(met)} of {len(tight)} "
        f"(gains: min {min(gains, default=0) * 100:.1f} %, mean {statistics.fmean(gains or [0]) * 100:.1f} %, "
        f"max {max(gains, default=0) * 100:.1f} %)",
        f"- twice 1F1B's memory, above the lower bound on average: {statistics.fmean(loose or [0]) * 100:.2f} % "
        f"(max {max(loose, default=0) * 100:.2f} %) over {len(loose)} rows (target: within 2 %)",
        f"- synthesis at p = 8, m = 32: at most {max(big, default=0):.2f} s (target: under 10 s)",
    ]
    return "\n".join(lines)


def curve() -> str:
    """Synthesis time by size, on the I:W = 3:1 model with a latency of 20 % of F under 1F1B's memory."""
    out = ["| p | m | actions | seconds | evaluations | above bound |", "|---:|---:|---:|---:|---:|---:|"]
    for p in (4, 8, 16):
        for m in (8, 16, 32, 64):
            costs = uniform(p, latency=0.2, i=1.5, w=0.5)
            start = time.perf_counter()
            rep = report_of(synthesize(costs, p, m, memory=min(p, m)))
            sec = time.perf_counter() - start
            out.append(f"| {p} | {m} | {3 * p * m} | {sec:.2f} | {rep.evaluations} | {rep.gap * 100:.1f}% |")
            print(out[-1], flush=True)
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--curve", action="store_true", help="only the synthesis-time curve")
    parser.add_argument("--pictures", action="store_true", help="only draw docs/synthesis-*.png")
    parser.add_argument(
        "--keep",
        type=float,
        default=suite.KEEP,
        help="share of a synthetic stage's activations "
        "W keeps (default 1/3; 0: W holds nothing, the simulator's count of micro-batches)",
    )
    parser.add_argument("--cases", nargs="+", default=None, help="only the cost models whose label has one of these")
    args = parser.parse_args()
    suite.KEEP = args.keep
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    if args.pictures:
        from .pictures import draw_all

        for path in draw_all():
            print(path)
    elif args.curve:
        curve()
    else:
        rows = []
        for label, make in SUITE:
            if args.cases and not any(c in label for c in args.cases):
                continue
            for p in args.ranks:
                costs = make(p)
                for m in args.microbatches:
                    for factor in (1, 2):
                        rows.append(row(label, costs, p, m, factor))
        print(table(rows))
        print()
        print(targets(rows))
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
