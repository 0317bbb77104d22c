"""Why the same plan runs at another level when built again (issue 49 item 2): one plan built many times,
under conditions taken in turn, the between-build spread per condition.

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.calibration --builds --ranks 2 --out out/builds   # ~1 min

Each round builds the plan (the calibrating plan P of :mod:`.space`, or ``--plan``) once per condition, in
turn, each build 1 untimed and ``--steps`` timed steps (the slowest rank's ``train_step`` from a barrier):

* ``free``: as the benchmark runs it, the kernel placing the ranks;
* ``pinned``: each rank on its own core (``stagewise run --pin-cores``'s pinning; only where the ranks do not
  outnumber the cores);
* ``pinned, gc frozen``: pinned, and the garbage collector's objects frozen after the build (``gc.freeze``),
  so that no full collection walks the model's objects in a timed step.

Per build it keeps the cores each rank ran on (``/proc/self/stat``, sampled after each step), whether two ranks
shared one, and the low bits of the first parameter's address (the memory layout). The worker (``--builds``) runs
:func:`run` on every rank; rank 0 writes the builds as JSON, and :func:`table` gives per condition the
between-build sd (log medians) and the within-build sd.
"""

from __future__ import annotations

import argparse
import gc
import os
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

# internal: the pinning stagewise run --pin-cores does, in workers launched by torchrun directly
from stagewise.runtime.measure.cores import pin_local_rank

from .._launch import timed_step
from ..fidelity.workloads import workloads
from .groups import released
from .noise import between_builds, within_builds
from .space import GLOBAL_BATCH, PlanSpec, calibrating

CONDITIONS = ("free", "pinned", "pinned, gc frozen")


def cpu_now() -> int:
    """The core this process last ran on (``/proc/self/stat``'s 39th field)."""
    with open("/proc/self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[36])


def place(condition: str, everywhere: set[int]) -> None:
    """Free: every core; pinned: the local rank's own (:func:`~stagewise.runtime.measure.cores.pin_local_rank`,
    ``stagewise run --pin-cores``'s)."""
    os.sched_setaffinity(0, everywhere)
    if condition != "free":
        pin_local_rank()


def samples(plan: PlanSpec) -> int:
    return GLOBAL_BATCH // (plan.dp * plan.microbatches)


def one_build(work: Any, plan: PlanSpec, profile: Any, condition: str, steps: int, build: Callable) -> dict[str, Any]:
    """``build(work, plan, profile, sample)`` (the worker's) under ``condition``, 1 untimed and ``steps`` timed
    steps: the steps, each rank's cores and parameter address, and the steps two ranks ended on one core."""
    x, y = work.data(GLOBAL_BATCH)
    gc.unfreeze()
    gc.collect()
    with released():
        pipe = build(work, plan, profile, x[: samples(plan)])
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
        gc.unfreeze()  # else a frozen cycle keeps the pipeline, and its groups' threads, alive
        del pipe, params
    shared = sum(1 for k in range(steps) if len({e["cpus"][k] for e in everyone}) < len(everyone))
    return {"condition": condition, "steps": times, "ranks": everyone, "steps sharing a core": shared}


def run(args: argparse.Namespace, build: Callable, profiles: Callable) -> dict[str, Any]:
    """Every rank: ``args.rounds`` rounds of one build per condition of the calibrating plan (module docstring);
    ``build`` and ``profiles``: the worker's pipeline builder and profiler (``alone_profiles``)."""
    work = workloads()[args.workload]
    world = dist.get_world_size()
    plan = calibrating(world)
    x, y = work.data(GLOBAL_BATCH)
    profile = profiles(work, x, y, [samples(plan)])[samples(plan)]
    everywhere = os.sched_getaffinity(0)
    # more ranks than cores cannot be pinned one a core (refused, as stagewise run --pin-cores refuses it)
    conditions = CONDITIONS if world <= len(everywhere) else CONDITIONS[:1]
    builds = []
    for r in range(args.rounds):
        for condition in conditions[:: -1 if r % 2 else 1]:
            place(condition, everywhere)
            builds.append(one_build(work, plan, profile, condition, args.steps, build))
    return {"workload": args.workload, "plan": plan._asdict(), "world": world, "builds": builds,
            "load": os.getloadavg()}  # fmt: skip


def table(result: dict[str, Any]) -> list[str]:
    """Per condition: builds, between- and within-build sd, the median step, the steps two ranks shared a core."""
    lines = ["| condition | builds | between-build sd | within-build sd | median step | steps sharing a core |",
             "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for condition in CONDITIONS:
        mine = [b for b in result["builds"] if b["condition"] == condition]
        if not mine:
            continue
        between, _ = between_builds([[b["steps"] for b in mine]])
        within, _ = within_builds([[b["steps"] for b in mine]])
        median = sorted(s for b in mine for s in b["steps"])[len(mine) * len(mine[0]["steps"]) // 2]
        shared = sum(b["steps sharing a core"] for b in mine)
        lines.append(f"| {condition} | {len(mine)} | {between:.1%} | {within:.1%} | {median * 1e3:.1f} ms | {shared} |")
    return lines
