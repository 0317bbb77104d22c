"""One rank of ``python -m benchmarks.calibration``: calibrate on plan P's run, then predict and run every Q.

1. rank 0 profiles the layers alone on P's micro-batch (``sw.profile``, the loss too); every rank gets it;
2. P (:func:`.space.calibrating`) runs 2 warm-up and 3 steps under a
   :class:`~stagewise.runtime.RunCalibrator` (the default warm-up and window), which calibrates; the link's
   bandwidth a ping-pong's (:func:`prior_bandwidth`) where P's transfers cannot identify it;
3. for each Q of :func:`.space.held_out`, in the seeded order: the prediction first, from the calibration only
   (:func:`stagewise.planning.recalibrate.held_out_costs`: Q's cut, its micro-batch, its replicas' SYNC; the
   ranks sharing the node's cores); then Q runs ``--warmup`` untimed and ``--steps`` timed steps (each from a
   barrier, the slowest rank's ``train_step``).

Rank 0 writes every plan's prediction, interval and measured steps as JSON (``--out``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import stagewise as sw
from stagewise.partition import stage_counts

# internal: the held-out prediction itself (a plan's costs from the calibration, before it runs)
from stagewise.planning.recalibrate import held_out_costs
from stagewise.runtime import RunCalibrator

# internal: the ping-pong probe alone (calibrate() probes much else), for the link's prior bandwidth
from stagewise.runtime.measure.links import ping_pong

from .._launch import timed_step
from ..fidelity.workloads import workloads
from .space import GLOBAL_BATCH, PlanSpec, calibrating, held_out


def alone_profile(work: Any, x: Any, y: Any) -> sw.LayerProfile:
    text: list[Any] = [None]
    if dist.get_rank() == 0:
        model = sw.build_model(work.layers(), seed=0)
        text = [sw.profile(model, x, repeats=5, warmup=2, rounds=2, loss_fn=work.loss, targets=y).to_json()]
    dist.broadcast_object_list(text, 0)
    return sw.LayerProfile.from_json(text[0])


def prior_bandwidth() -> float:
    """Bytes/s between ranks 0 and 1 (a ping-pong, 3 rounds): the bandwidth the calibration keeps where P's
    transfers, all one size, cannot identify it (:mod:`stagewise.planning.link_fit`)."""
    return ping_pong(0, 1, rounds=3, timeout=300).bandwidth if dist.get_world_size() > 1 else float("inf")


def counts_for(plan: PlanSpec, layers: Any, profile: sw.LayerProfile, v: int) -> Any:
    """Explicit counts per stage for uniform / parameters / time (the same on every rank); "balanced" is left
    to the pipeline (the default path itself)."""
    if plan.partition == "balanced":
        return "balanced"
    named = sw.build_model(layers, seed=0)
    params = [float(sum(p.numel() for p in m.parameters())) for m in named.children()]
    return stage_counts(len(profile), plan.pp * v, plan.partition, profile=profile, parameters=lambda: params)


def virtual(name: str) -> int | None:
    allowed = sw.schedule_info(name).virtual_stages
    return 2 if allowed is None or 2 in allowed else None


def build(work: Any, plan: PlanSpec, profile: sw.LayerProfile, sample: Any) -> sw.Pipeline:
    v = virtual(plan.schedule)
    parallel = sw.ParallelConfig(pp=plan.pp, dp=plan.dp) if plan.dp > 1 else None
    return sw.Pipeline(
        work.layers(), loss_fn=work.loss, schedule=plan.schedule, microbatches=plan.microbatches,
        virtual_stages=v, partition=counts_for(plan, work.layers(), profile, v or 1), sample_inputs=sample,
        parallel=parallel, seed=0, timeout=600,
    )  # fmt: skip


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
    cal = calibrator.calibration
    rows = []
    for plan in held_out(world, args.plans):
        b_q = GLOBAL_BATCH // (plan.dp * plan.microbatches)
        q = build(work, plan, profile, x[:b_q])
        counts = [len(r) for r in q.layer_ranges]
        costs = held_out_costs(cal, profile, counts, batch_ratio=b_q / b_p, dp=plan.dp)
        predicted = cal.predict(q.schedule, costs, processes_per_node=world)
        for _ in range(args.warmup):
            timed_step(q, x, y)
        steps = [timed_step(q, x, y) for _ in range(args.steps)]
        rows.append({"plan": plan._asdict(), "counts": counts, "predicted": predicted.step,
                     "low": predicted.low, "high": predicted.high, "steps": steps})  # fmt: skip
        del q
    return {
        "workload": args.workload,
        "world": world,
        "calibrating": p_plan._asdict(),
        "calibration": calibrator.records[0],
        "profile": profile.to_json(),
        "plans": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workload", default="gpt256")
    parser.add_argument("--plans", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5)
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
