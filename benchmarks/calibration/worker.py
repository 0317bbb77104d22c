"""One rank of ``python -m benchmarks.calibration``: calibrate on plan P's run, then predict and run every Q.

1. rank 0 profiles the layers alone (``sw.profile``, the loss too) at each micro-batch size the plans run,
   P's among them; every rank gets them;
2. every rank probes the replicas' all-reduce link (:mod:`.reduce_probe`; P is dp 1 and holds none); P
   (:func:`.space.calibrating`) runs 2 warm-up and 3 steps under a
   :class:`~stagewise.runtime.RunCalibrator` (the default warm-up and window), which calibrates; the link's
   bandwidth a ping-pong's (:func:`prior_bandwidth`) where P's transfers cannot identify it; then ``--steps``
   more timed as every Q is (the ``after`` model's bias is taken against them); P's calibrating timelines are
   kept, and calibrated each way of :mod:`.model`;
3. for each Q of :func:`.space.held_out`, in the seeded order: the predictions first, from the calibration only
   (:func:`.model.predictions`: Q's cut, its micro-batch, its replicas' SYNC; the ranks sharing the node's
   cores); then Q runs ``--warmup`` untimed and ``--steps`` timed steps (each from a barrier, the slowest
   rank's ``train_step``).

Rank 0 writes every plan's predictions, intervals and measured steps as JSON (``--out``), and what an offline
refit needs (``kept``: the profiles, P's timelines, cut, cores and prior bandwidth; :mod:`.refit`).
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
from stagewise.runtime import RunCalibrator

# internal: the ping-pong probe alone (calibrate() probes much else), for the link's prior bandwidth
from stagewise.runtime.measure.links import ping_pong

from .._launch import timed_step
from ..fidelity.workloads import workloads
from .model import calibrations, kept, predictions
from .reduce_probe import reduce_link
from .space import GLOBAL_BATCH, PlanSpec, calibrating, held_out


def alone_profiles(work: Any, x: Any, y: Any, sizes: Any) -> dict[int, sw.LayerProfile]:
    """The layers profiled alone on rank 0 at each micro-batch size of ``sizes`` (samples), handed round."""
    text: list[Any] = [None]
    if dist.get_rank() == 0:
        model = sw.build_model(work.layers(), seed=0)
        text = [{b: sw.profile(model, x[:b], repeats=5, warmup=2, rounds=2, loss_fn=work.loss, targets=y[:b]).to_json()
                 for b in sorted(set(sizes))}]  # fmt: skip
    dist.broadcast_object_list(text, 0)
    return {int(b): sw.LayerProfile.from_json(t) for b, t in text[0].items()}


def micro_batch(plan: PlanSpec) -> int:
    return GLOBAL_BATCH // (plan.dp * plan.microbatches)


def calibrated(
    work: Any, p_plan: PlanSpec, profiles: dict[int, sw.LayerProfile], steps: int = 5
) -> tuple[Any, dict[str, Any], dict]:
    """P run until its :class:`RunCalibrator` calibrates, then ``steps`` more timed as every Q is (``timed_step``):
    that calibrator's first record, the models' calibrations (:func:`.model.calibrations`) of the same timelines,
    and what an offline refit needs (:func:`.model.kept`)."""
    world = dist.get_world_size()
    x, y = work.data(GLOBAL_BATCH)
    b_p = micro_batch(p_plan)
    reduce = reduce_link()
    pipe = build(work, p_plan, profiles[b_p], x[:b_p])
    calibrator = RunCalibrator(pipe, profiles[b_p], processes=world, bandwidth=prior_bandwidth())
    seen = []
    while calibrator.calibration is None:
        pipe.train_step(x, y)
        seen.append(pipe.timeline(gather=True))
        calibrator.observe(seen[-1])
    timelines, counts = seen[calibrator.warmup :], [len(r) for r in pipe.layer_ranges]
    timed = [timed_step(pipe, x, y) for _ in range(steps)]
    cores, bandwidth = calibrator.cores, calibrator.bandwidth
    cals = calibrations(timelines, pipe.schedule, profiles[b_p], counts, cores, bandwidth, reduce, timed)
    keep = kept(profiles, timelines, p_plan._asdict(), counts, cores, bandwidth, world, reduce, timed)
    del pipe
    return calibrator.records[0], cals, keep


def predicted_row(cals: dict, profiles: dict[int, sw.LayerProfile], p_plan: PlanSpec, plan: PlanSpec, q: Any) -> dict:
    """Q's predictions by each model of :mod:`.model`, before it runs: the ``after`` model's as ``predicted`` /
    ``low`` / ``high`` (what the figures judge), the others' under their names (``"before"``, ``"at batch"``)."""
    counts = [len(r) for r in q.layer_ranges]
    got = predictions(cals, profiles, micro_batch(p_plan), q.schedule, counts, micro_batch(plan), plan.dp,
                      dist.get_world_size())  # fmt: skip
    others = {m: {"predicted": p.step, "low": p.low, "high": p.high} for m, p in got.items() if m != "after"}
    after = got["after"]
    return {"plan": plan._asdict(), "name": plan.describe(), "counts": counts, "virtual": virtual(plan.schedule),
            "predicted": after.step, "low": after.low, "high": after.high, **others}  # fmt: skip


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
    p_plan, plans = calibrating(world), held_out(world, args.plans)
    profiles = alone_profiles(work, x, y, [micro_batch(p) for p in (p_plan, *plans)])
    record, cals, keep = calibrated(work, p_plan, profiles, args.steps)
    rows = []
    for plan in plans:
        b_q = micro_batch(plan)
        q = build(work, plan, profiles[micro_batch(p_plan)], x[:b_q])
        row = predicted_row(cals, profiles, p_plan, plan, q)
        for _ in range(args.warmup):
            timed_step(q, x, y)
        rows.append({**row, "steps": [timed_step(q, x, y) for _ in range(args.steps)]})
        del q
    return {
        "workload": args.workload,
        "world": world,
        "calibrating": p_plan._asdict(),
        "calibration": record,
        "overhead_s": cals["after"].overhead,
        "bias_after": cals["after"].bias,
        "plans": rows,
        "kept": keep,
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
