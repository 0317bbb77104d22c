"""One rank of ``python -m benchmarks.regret``: calibrate on plan P, sweep P and every Q, then time the pick and
the best again, alternating.

1. as :mod:`benchmarks.calibration.worker`: the layers profiled alone, P run under a
   :class:`~stagewise.runtime.RunCalibrator` until it calibrates;
2. the sweep: P and the plans Q of :func:`benchmarks.calibration.space.held_out` (4 processes: 32 of them),
   each predicted from the calibration before it runs, then ``--warmup`` untimed and ``--steps`` timed steps;
3. the planner's pick (the least predicted step) and the sweep's best (the least measured median) built again
   and timed ``--again`` rounds, one step of each per round, so that both see the same load.

Rank 0 writes the sweep and the steps measured again as JSON (``--out``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

# internal: the held-out prediction itself (a plan's costs from the calibration, before it runs)
from stagewise.planning.recalibrate import RunCalibration, held_out_costs
from stagewise.runtime import RunCalibrator

from .._launch import timed_step
from ..calibration.space import GLOBAL_BATCH, PlanSpec, calibrating, held_out
from ..calibration.worker import alone_profile, build, prior_bandwidth
from ..fidelity.workloads import Workload, workloads
from .report import best, pick


def predicted(cal: RunCalibration, profile: Any, q: Any, plan: PlanSpec, b_p: int) -> Any:
    b_q = GLOBAL_BATCH // (plan.dp * plan.microbatches)
    counts = [len(r) for r in q.layer_ranges]
    costs = held_out_costs(cal, profile, counts, batch_ratio=b_q / b_p, dp=plan.dp)
    return cal.predict(q.schedule, costs, processes_per_node=dist.get_world_size())


def sweep(work: Workload, plans: list[PlanSpec], cal: RunCalibration, profile: Any, args: Any) -> list[dict]:
    x, y = work.data(GLOBAL_BATCH)
    b_p = GLOBAL_BATCH // calibrating(dist.get_world_size()).microbatches
    rows = []
    for plan in plans:
        b_q = GLOBAL_BATCH // (plan.dp * plan.microbatches)
        q = build(work, plan, profile, x[:b_q])
        guess = predicted(cal, profile, q, plan, b_p)
        for _ in range(args.warmup):
            timed_step(q, x, y)
        steps = [timed_step(q, x, y) for _ in range(args.steps)]
        rows.append({"plan": plan._asdict(), "name": plan.describe(), "counts": [len(r) for r in q.layer_ranges],
                     "predicted": guess.step, "low": guess.low, "high": guess.high, "steps": steps})  # fmt: skip
        del q
    return rows


def again(work: Workload, chosen: dict[str, PlanSpec], profile: Any, rounds: int) -> dict[str, list[float]]:
    x, y = work.data(GLOBAL_BATCH)
    pipes = {}
    for key, plan in chosen.items():
        b_q = GLOBAL_BATCH // (plan.dp * plan.microbatches)
        pipes[key] = build(work, plan, profile, x[:b_q])
        timed_step(pipes[key], x, y)
    steps: dict[str, list[float]] = {key: [] for key in pipes}
    for _ in range(rounds):
        for key, pipe in pipes.items():
            steps[key].append(timed_step(pipe, x, y))
    return steps


def run(args: argparse.Namespace) -> dict[str, Any]:
    world = dist.get_world_size()
    work = workloads()[args.workload]
    x, y = work.data(GLOBAL_BATCH)
    p_plan = calibrating(world)
    b_p = GLOBAL_BATCH // p_plan.microbatches
    profile = alone_profile(work, x[:b_p], y[:b_p])
    pipe = build(work, p_plan, profile, x[:b_p])
    calibrator = RunCalibrator(pipe, profile, processes=world, bandwidth=prior_bandwidth())
    while calibrator.calibration is None:
        pipe.train_step(x, y)
        calibrator.observe()
    del pipe
    cal = calibrator.calibration
    plans = [p_plan, *held_out(world, args.plans)]
    rows = sweep(work, plans, cal, profile, args)
    i, j = pick(rows), best(rows)
    steps = again(work, {"pick": plans[i], "best": plans[j]} if i != j else {"pick": plans[i]}, profile, args.again)
    steps.setdefault("best", steps["pick"])
    return {"workload": args.workload, "world": world, "plans": rows, "pick": plans[i].describe(),
            "best": plans[j].describe(), "again": steps, "calibration": calibrator.records[0]}  # fmt: skip


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
