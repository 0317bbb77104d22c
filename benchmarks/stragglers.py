"""A rank slowed mid-run, detected and named (issue 49 item 3), with the oracle of static cuts.

    sudo OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.stragglers --out out/stragglers   # cgroup v1, root
    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.stragglers --emulate --out out/stragglers  # no root

Two ranks of one thread run the demo GPT (d 64, 10 layers) with 1F1B, 8 micro-batches, under a
:class:`~stagewise.runtime.RunCalibrator`: it calibrates in its first steps; then rank 1 is held to 50 % of
a core, then 25 %, then released (cgroup v1: ``cpu.cfs_quota_us`` of ``cpu.cfs_period_us = 10000``, a 10 ms
period, so the slow rank is slower rather than bursty; ``--emulate``: the same pipeline rebuilt with
``emulate_slowdown`` 2 and 4 for rank 1 instead, as the unit tests do). Per phase: the steps until rank 1
is named, its measured speed, the cut the line proposes; and the oracle: every static cut ``[c, 10 - c]``
timed under the 50 % throttle, the best against the proposed one (what a live re-partition would reach).
Writes ``stragglers.json`` and prints the events.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

from ._launch import launched, on_ranks, timed_step

CGROUP = Path("/sys/fs/cgroup/cpu/stagewise_straggler")
PERIOD_US = 10_000


def throttle(share: float | None) -> None:
    """Hold this process to ``share`` of a core (None: release it)."""
    CGROUP.mkdir(exist_ok=True)
    (CGROUP / "cpu.cfs_period_us").write_text(str(PERIOD_US))
    (CGROUP / "cpu.cfs_quota_us").write_text("-1" if share is None else str(int(PERIOD_US * share)))
    (CGROUP / "cgroup.procs").write_text(str(os.getpid()))


def rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import stagewise as sw
    from stagewise.runtime import RunCalibrator

    from .fidelity.workloads import workloads

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    work = workloads()["gpt64"]
    x, y = work.data(work.microbatch * 8)

    def pipe(partition: Any = "balanced", slowdown: float = 1.0) -> Any:
        return sw.Pipeline(work.layers(), loss_fn=work.loss, schedule="1f1b", microbatches=8, partition=partition,
                           emulate_slowdown=[1.0, slowdown], seed=0)  # fmt: skip

    events: list[dict[str, Any]] = []
    current = pipe()
    calibrator = RunCalibrator(current, on_event=lambda e: events.append({**e, "step": len(steps)}))
    steps: list[dict[str, Any]] = []
    for phase, share, n in (("calibrate", None, 5), ("full speed", None, 4), ("50 %", 0.5, args.steps),
                            ("25 %", 0.25, args.steps), ("released", None, args.steps)):  # fmt: skip
        if args.emulate:
            current = pipe(slowdown=1.0 if share is None else 1.0 / share)
        elif rank == 1:
            throttle(share)
        for _ in range(n):
            took = timed_step(current, x, y)
            calibrator.observe(current.timeline(gather=True))
            steps.append({"phase": phase, "seconds": took})
    oracle = {}
    if args.oracle:
        if not args.emulate and rank == 1:
            throttle(0.5)
        for c in range(1, 10):
            p = pipe([c, 10 - c], 1.0 if not args.emulate else 2.0)
            timed_step(p, x, y)
            oracle[c] = statistics.median(timed_step(p, x, y) for _ in range(3))
        if not args.emulate and rank == 1:
            throttle(None)
    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        out = {"steps": steps, "events": events, "oracle at 50 %": oracle, "load": os.getloadavg(),
               "mode": "emulate_slowdown" if args.emulate else "cgroup v1"}  # fmt: skip
        (args.out / "stragglers.json").write_text(json.dumps(out))
        for e in events:
            print(e)
        if oracle:
            print("oracle at 50 %:", {c: round(s * 1e3, 1) for c, s in oracle.items()})
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("out/stragglers"))
    parser.add_argument("--steps", type=int, default=8, help="steps per throttled phase")
    parser.add_argument("--emulate", action="store_true", help="emulate_slowdown instead of a cgroup (no root)")
    parser.add_argument("--no-oracle", dest="oracle", action="store_false", help="skip the static cuts' sweep")
    args = parser.parse_args(argv)
    if launched():
        rank_main(args)
        return 0
    return on_ranks(2, "benchmarks.stragglers", sys.argv[1:] if argv is None else argv, OMP_NUM_THREADS="1")


if __name__ == "__main__":
    sys.exit(main())
