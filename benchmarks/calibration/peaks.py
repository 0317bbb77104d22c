"""The activation peak, predicted against the runtime's meter (issue 49 item 2: "within 5 %").

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.calibration --peaks --out out/peaks   # 2 and 4 ranks

Bytes do not depend on the machine's load, so this runs apart from the timed benchmark and needs no quiet
machine. Per plan Q of :mod:`.space` (the held-out plans; P is left out as there): predicted, each rank's
peak of activation bytes alive at once, the simulator's ``peak_activation_bytes`` under Q's stage costs from
the layers profiled alone (:func:`.model.peaks`: ``before`` scales P's micro-batch's bytes linearly to Q's,
``after`` takes the profile at Q's micro-batch, as the timed models do; no run of Q enters either);
measured, each rank's ``Pipeline.memory_report()["peak_bytes"]`` on Q's second step, built with
``measure_memory=True`` (the meter: bytes saved for backward, each storage byte once, not RSS). Each plan's
figure is its highest rank's peak (what a memory limit binds), relative error predicted over measured.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from ..fidelity.workloads import workloads
from .groups import released
from .model import peaks
from .space import GLOBAL_BATCH, calibrating, held_out

#: the issue's goal: the predicted peak within 5 % of the meter's
GOAL = 0.05


def run(args: argparse.Namespace, build: Callable[..., Any], profiles: Callable[..., Any]) -> dict[str, Any]:
    """Every rank: each Q built with the meter, 2 steps, every rank's peak gathered; rank 0's result has both
    models' predictions beside them. ``build``/``profiles``: the worker's builder and :func:`alone_profiles`."""
    world = dist.get_world_size()
    work = workloads()[args.workload]
    x, y = work.data(GLOBAL_BATCH)
    p_plan, plans = calibrating(world), held_out(world, args.plans)
    size = {q: GLOBAL_BATCH // (q.dp * q.microbatches) for q in (p_plan, *plans)}
    profile = profiles(work, x, y, sorted(set(size.values())))
    rows = []
    for plan in plans:
        with released():
            pipe = build(work, plan, profile[size[p_plan]], x[: size[plan]], measure_memory=True)
            for _ in range(2):
                pipe.train_step(*pipe.local_batch(x, y))
            mine = [int(pipe.memory_report()["peak_bytes"]), [len(r) for r in pipe.layer_ranges], pipe.schedule]
            del pipe
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, mine[0])
        predicted = peaks(profile, size[p_plan], mine[2], mine[1], size[plan])
        rows.append({"plan": plan._asdict(), "name": plan.describe(), "measured": everyone, **predicted})
    return {"workload": args.workload, "world": world, "plans": rows}


def errors(result: dict[str, Any], model: str) -> list[float]:
    """Per plan: the highest rank's predicted peak over the highest measured, less 1."""
    return [max(r[model]) / max(r["measured"]) - 1 for r in result["plans"]]


def table(results: list[dict[str, Any]]) -> list[str]:
    """Per job and model: plans, mean and largest absolute error, the share within the goal, the worst plan."""
    lines = [
        "| workload | ranks | model | plans | MAE | max | within 5 % | worst plan |",
        "|---|---:|---|---:|---:|---:|---:|---|",
    ]
    for result in results:
        for model in ("after", "before"):
            e = errors(result, model)
            worst = max(range(len(e)), key=lambda k: abs(e[k]))
            name = result["plans"][worst]["name"]
            lines.append(
                f"| {result['workload']} | {result['world']} | {model} | {len(e)} "
                f"| {statistics.mean(abs(v) for v in e):.1%} | {max(abs(v) for v in e):.1%} "
                f"| {sum(abs(v) <= GOAL for v in e) / len(e):.0%} | {name} ({e[worst]:+.1%}) |"
            )
    return lines
