"""Why the same plan runs at another level when built again (issue 49 item 2): one plan built many times,
under conditions taken in turn, the between-build spread per condition.

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.calibration.builds --out out/builds     # ~1-2 min, 2 ranks

Each round builds the plan (the calibrating plan P of :mod:`.space`, or ``--plan``) once per condition, in
turn, each build 1 untimed and ``--steps`` timed steps (the slowest rank's ``train_step`` from a barrier):

* ``free``: as the benchmark runs it, the kernel placing the ranks;
* ``pinned``: each rank on one core (``os.sched_setaffinity``: local rank r on core r mod the cores);
* ``pinned, gc frozen``: pinned, and the garbage collector's objects frozen after the build (``gc.freeze``),
  so that no full collection walks the model's objects in a timed step.

Per build it keeps the cores each rank ran on (``/proc/self/stat``, sampled after each step), whether two ranks
shared one, and the low bits of the first parameter's address (the memory layout). Rank 0 writes the builds
as JSON and prints, per condition, the between-build sd (log medians) and the within-build sd.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .._launch import environ, launched, timed_step, torchrun
from ..fidelity.workloads import workloads
from .noise import between_builds, within_builds
from .space import GLOBAL_BATCH, PlanSpec, calibrating
from .worker import alone_profiles, build, micro_batch

CONDITIONS = ("free", "pinned", "pinned, gc frozen")


def cpu_now() -> int:
    """The core this process last ran on (``/proc/self/stat``'s 39th field)."""
    with open("/proc/self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[36])


def place(condition: str, everywhere: set[int]) -> None:
    if condition == "free":
        os.sched_setaffinity(0, everywhere)
    else:
        cores = sorted(everywhere)
        os.sched_setaffinity(0, {cores[int(os.environ.get("LOCAL_RANK", "0")) % len(cores)]})


def one_build(work: Any, plan: PlanSpec, profile: Any, condition: str, steps: int) -> dict[str, Any]:
    x, y = work.data(GLOBAL_BATCH)
    gc.unfreeze()
    gc.collect()
    pipe = build(work, plan, profile, x[: micro_batch(plan)])
    if condition.endswith("gc frozen"):
        gc.collect()
        gc.freeze()
    timed_step(pipe, x, y)
    times, cpus = [], []
    for _ in range(steps):
        times.append(timed_step(pipe, x, y))
        cpus.append(cpu_now())
    params = list(pipe.parameters())
    address = params[0].data_ptr() if params else 0
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {"cpus": cpus, "address": address % (1 << 21)})
    del pipe
    shared = sum(1 for k in range(steps) if len({e["cpus"][k] for e in everyone}) < len(everyone))
    return {"condition": condition, "steps": times, "ranks": everyone, "steps sharing a core": shared}


def run(args: argparse.Namespace) -> dict[str, Any]:
    work = workloads()[args.workload]
    world = dist.get_world_size()
    plan = calibrating(world) if not args.plan else PlanSpec(*args.plan[:1], *map(int, args.plan[1:2]), args.plan[2],
                                                              *map(int, args.plan[3:5]))  # fmt: skip
    x, y = work.data(GLOBAL_BATCH)
    profile = alone_profiles(work, x, y, [micro_batch(plan)])[micro_batch(plan)]
    everywhere = os.sched_getaffinity(0)
    builds = []
    for r in range(args.rounds):
        for condition in CONDITIONS[:: -1 if r % 2 else 1]:
            place(condition, everywhere)
            builds.append(one_build(work, plan, profile, condition, args.steps))
    return {"workload": args.workload, "plan": plan._asdict(), "world": world, "builds": builds,
            "load": os.getloadavg()}  # fmt: skip


def table(result: dict[str, Any]) -> list[str]:
    lines = ["| condition | builds | between-build sd | within-build sd | median step | steps sharing a core |",
             "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for condition in CONDITIONS:
        mine = [b for b in result["builds"] if b["condition"] == condition]
        between, _ = between_builds([[b["steps"] for b in mine]])
        within, _ = within_builds([[b["steps"] for b in mine]])
        median = sorted(s for b in mine for s in b["steps"])[len(mine) * len(mine[0]["steps"]) // 2]
        shared = sum(b["steps sharing a core"] for b in mine)
        lines.append(f"| {condition} | {len(mine)} | {between:.1%} | {within:.1%} | {median * 1e3:.1f} ms | {shared} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("out/builds"))
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--workload", default="gpt256")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--plan", nargs=5, metavar=("SCHEDULE", "M", "PARTITION", "PP", "DP"))
    args = parser.parse_args(argv)
    if not launched():
        args.out.mkdir(parents=True, exist_ok=True)
        done = subprocess_run(args.ranks, sys.argv[1:] if argv is None else argv)
        if done:
            return done
        result = json.loads((args.out / "builds.json").read_text())
        print("\n".join(table(result)))
        return 0
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        result = run(args)
        if dist.get_rank() == 0:
            (args.out / "builds.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()
    return 0


def subprocess_run(ranks: int, argv: list[str]) -> int:
    import subprocess

    command = torchrun(ranks, "benchmarks.calibration.builds", argv)
    return subprocess.run(command, env=environ(OMP_NUM_THREADS="1")).returncode


if __name__ == "__main__":
    sys.exit(main())
