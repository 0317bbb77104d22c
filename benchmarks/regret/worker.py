"""One rank of ``python -m benchmarks.regret``: calibrate on plan P, sweep P and every Q, then time the pick and
the best again, alternating.

1. as :mod:`benchmarks.calibration.worker`: the layers profiled alone at each micro-batch size, P run under a
   :class:`~stagewise.runtime.RunCalibrator` until it calibrates, its timelines calibrated both ways of
   :mod:`benchmarks.calibration.model` (``before``: linear in the micro-batch, the bias; ``after``: a CPU
   cost per action on the shared cores, the layers at each plan's micro-batch);
2. the sweep: P and the plans Q of :func:`benchmarks.calibration.space.held_out` (4 processes: 32 of them),
   each predicted by both models before it runs, then ``--warmup`` untimed and ``--steps`` timed steps;
3. each model's pick (its least predicted step) and the sweep's best (the least measured median) built again
   and timed ``--again`` rounds, one step of each per round, so that all see the same load.

Rank 0 writes the sweep, the steps measured again and what an offline refit needs as JSON (``--out``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .._launch import timed_step
from ..calibration.groups import released
from ..calibration.space import GLOBAL_BATCH, PlanSpec, calibrating, held_out
from ..calibration.worker import alone_profiles, build, calibrated, micro_batch, predicted_row
from ..fidelity.workloads import Workload, workloads
from .report import best, pick


def sweep(work: Workload, plans: list[PlanSpec], cals: dict, profiles: dict, args: Any) -> list[dict]:
    x, y = work.data(GLOBAL_BATCH)
    p_plan = calibrating(dist.get_world_size())
    rows = []
    for plan in plans:
        with released():
            q = build(work, plan, profiles[micro_batch(p_plan)], x[: micro_batch(plan)])
            row = predicted_row(cals, profiles, p_plan, plan, q)
            for _ in range(args.warmup):
                timed_step(q, x, y)
            rows.append({**row, "steps": [timed_step(q, x, y) for _ in range(args.steps)]})
            del q
    return rows


def again(work: Workload, chosen: dict[str, PlanSpec], profile: Any, rounds: int) -> dict[str, list[float]]:
    x, y = work.data(GLOBAL_BATCH)
    with released():
        pipes = {}
        for key, plan in chosen.items():
            pipes[key] = build(work, plan, profile, x[: micro_batch(plan)])
            timed_step(pipes[key], x, y)
        steps: dict[str, list[float]] = {key: [] for key in pipes}
        for _ in range(rounds):
            for key in pipes:
                steps[key].append(timed_step(pipes[key], x, y))
        del pipes
    return steps


def run(args: argparse.Namespace) -> dict[str, Any]:
    world = dist.get_world_size()
    work = workloads()[args.workload]
    x, y = work.data(GLOBAL_BATCH)
    p_plan = calibrating(world)
    plans = [p_plan, *held_out(world, args.plans)]
    profiles = alone_profiles(work, x, y, [micro_batch(p) for p in plans])
    record, cals, keep = calibrated(work, p_plan, profiles, args.steps)
    rows = sweep(work, plans, cals, profiles, args)
    i, k, j = pick(rows), pick(rows, "before"), best(rows)
    chosen = {"pick": i, "pick before": k, "best": j}
    timed = {}  # one pipeline per distinct plan, timed alternately
    for key, at in chosen.items():
        timed.setdefault(at, key)
    steps = again(work, {key: plans[at] for at, key in timed.items()}, profiles[micro_batch(p_plan)], args.again)
    again_steps = {key: steps[timed[at]] for key, at in chosen.items()}
    return {"workload": args.workload, "world": world, "plans": rows, "pick": plans[i].describe(),
            "pick before": plans[k].describe(), "best": plans[j].describe(), "again": again_steps,
            "calibration": record, "overhead_s": cals["after"].overhead, "bias_after": cals["after"].bias,
            "kept": keep}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workload", default="gpt64")
    parser.add_argument("--plans", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--again", type=int, default=8)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        result = run(args)
        if dist.get_rank() == 0:
            args.out.write_text(json.dumps(result, default=str))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
