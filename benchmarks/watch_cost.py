"""What watching a run costs (issue 49 item 4): the step period of a pipeline whose every step the
:class:`~stagewise.runtime.Replanner` observes, against the same pipeline's steps unwatched, with one rank held
by a CPU quota.

    sudo OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.watch_cost --pin --out out/watch_cost

Two ranks of one thread train the demo GPT (d 64, 10 layers, 1F1B, 8 micro-batches) at a fixed cut per share
(the best static cut the stragglers benchmark found for it). Rank 1 is free, then held to 50 % and 25 % of a core
(cgroup v1, a 10 ms period: :class:`benchmarks.stragglers.Throttle`). Under each share, the arms alternate in
blocks of ``--block`` steps, ``--rounds`` rounds, the first arm of a round rotating: ``off`` (steps alone) and one
arm per watching mode (``--modes``: ``leader``, the Replanner's default, where one rank computes and the others
send their events, and a settled run is watched one step in three; ``leader-each``, the same on every step, as
before 2026-12-04 14:00; ``every``, where every rank computes alike on every step, as before 11:00). Each
watched arm has a Replanner of its own, warmed up (calibrated, the held rank named and probed) before the rounds;
its margin is too large for any gain (``margin_s``), so it decides, probes and logs as a run does but never
re-lays out, and the cut stays the one measured. A block is timed on rank 0 from a barrier to a barrier, so a
rank's watching that spills into the next step is counted. The cost: a watched arm's median period less the
unwatched one's, in ms and in % of the unwatched step. Writes ``watch_cost.json``, prints a table.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from ._launch import run_as_rank

#: the share of rank 1's core, and the cut measured under it (the stragglers benchmark's best static cuts)
SHARES = ((None, [5, 5]), (0.5, [7, 3]), (0.25, [9, 1]))
MODES = ("leader", "leader-each", "every")
#: each mode's Replanner options
OPTIONS: dict[str, dict[str, Any]] = {
    "leader": {"leader": True},
    "leader-each": {"leader": True, "settled_every": 1},
    "every": {"leader": False, "settled_every": 1},
}
#: arms that do part of the watch alone: a sync of every rank (a barrier), the timeline gathered
PARTS = ("sync", "gather")


def rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import stagewise as sw
    from stagewise.runtime import Replanner, RunCalibrator

    from .stragglers import Throttle, start_rank

    rank, work, x, y = start_rank(args.pin)
    throttle = Throttle(False, rank, args.cgroup)
    rows: list[dict[str, Any]] = []
    try:
        for share, cut in SHARES:
            if (share or 1.0) not in args.shares:
                continue
            throttle.set(share)
            pipe = sw.Pipeline(work.layers(), loss_fn=work.loss, schedule="1f1b", microbatches=8, partition=cut,
                               seed=0, optimizer=lambda ps: torch.optim.SGD(ps, lr=1e-3))  # fmt: skip
            xs, ys = pipe.local_batch(x, y)
            watchers = {
                mode: Replanner(pipe, RunCalibrator(pipe), steps=10_000, margin_s=1e9, **OPTIONS[mode])
                for mode in args.modes
            }
            for _ in range(args.warmup):  # calibrated, the held rank named and probed, in every arm
                for replanner in watchers.values():
                    pipe.train_step(xs, ys)
                    replanner.observe()
            seen = {mode: [0, 0] for mode in watchers}  # steps watched, steps run, in the timed blocks
            after: dict[str, Any] = {
                "sync": dist.barrier,
                "gather": functools.partial(pipe.timeline, gather=True),
                **{mode: counted(w, seen[mode]) for mode, w in watchers.items()},
            }
            arms = ["off", *args.parts, *args.modes]
            periods: dict[str, list[float]] = {a: [] for a in arms}
            for r in range(args.rounds):
                for arm in arms[r % len(arms) :] + arms[: r % len(arms)]:
                    then = after.get(arm, lambda: None)
                    dist.barrier()
                    start = time.perf_counter()
                    for _ in range(args.block):
                        pipe.train_step(xs, ys)
                        then()
                    dist.barrier()
                    periods[arm].append((time.perf_counter() - start) / args.block)
            off = statistics.median(periods["off"])
            row: dict[str, Any] = {"share": share, "cut": cut, "off ms": off * 1e3, "periods": periods}
            for arm in arms[1:]:  # each round's block less that round's unwatched block: the drift cancels
                cost = statistics.median(a - b for a, b in zip(periods[arm], periods["off"]))
                row[f"{arm} ms"], row[f"{arm} %"] = cost * 1e3, cost / off * 100
            for mode in args.modes:
                row[f"{mode} probes"] = len(watchers[mode].probes)
                row[f"{mode} decisions"] = len(watchers[mode].log)
                row[f"{mode} watched"] = seen[mode][0] / max(seen[mode][1], 1)
            rows.append(row)
            del watchers, pipe
    finally:
        throttle.close()
    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        out = {"rows": rows, "load": os.getloadavg(), "block": args.block, "rounds": args.rounds}
        (args.out / "watch_cost.json").write_text(json.dumps(out))
        for line in table(rows, [*args.parts, *args.modes]):
            print(line)
    dist.destroy_process_group()


def counted(replanner: Any, seen: list[int]) -> Any:
    """``replanner.observe``, counting into ``seen`` the steps it watched and the steps it was called on."""

    def observe() -> None:
        seen[0] += replanner.cadence.due(int(replanner.pipe.train_steps))
        seen[1] += 1
        replanner.observe()

    return observe


def table(rows: list[dict[str, Any]], modes: list[str]) -> list[str]:
    """The rows as a markdown table: per share, the unwatched step and each arm's cost (and the share of the
    timed steps a watching mode watched)."""
    head = "| rank 1's share | cut | unwatched step ms | " + " | ".join(f"{m}: cost ms, % of a step" for m in modes)
    lines = [head + " |", "|---|---|---:|" + "---:|" * len(modes)]
    for r in rows:
        share = "free" if r["share"] is None else f"{r['share']:.0%}"
        costs = " | ".join(
            f"{r[f'{m} ms']:+.1f}, {r[f'{m} %']:+.1f} %" + (f" ({r[f'{m} watched']:.0%} watched)" if m in MODES else "")
            for m in modes
        )
        lines.append(f"| {share} | {r['cut']} | {r['off ms']:.1f} | {costs} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("out/watch_cost"))
    parser.add_argument("--block", type=int, default=10, help="steps per timed block")
    parser.add_argument("--rounds", type=int, default=12, help="rounds of one block per arm")
    parser.add_argument("--warmup", type=int, default=20, help="watched steps per mode before the rounds")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="the watching modes timed")
    parser.add_argument(
        "--parts",
        nargs="*",
        choices=PARTS,
        default=list(PARTS),
        help="arms that time a part of watching alone: a sync of every rank after each step, the timeline gathered",
    )
    parser.add_argument(
        "--shares", nargs="+", type=float, default=[1.0, 0.5, 0.25], help="rank 1's shares of a core timed (1: free)"
    )
    parser.add_argument("--cgroup", type=Path, default=None, help="the cpu cgroup to make the held rank's group in")
    parser.add_argument("--pin", action="store_true", help="each rank on a core of its own")
    return run_as_rank(2, "benchmarks.watch_cost", rank_main, parser.parse_args(argv), argv, OMP_NUM_THREADS="1")


if __name__ == "__main__":
    sys.exit(main())
