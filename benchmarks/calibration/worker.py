"""One rank of ``python -m benchmarks.calibration``: calibrate on plan P's runs, then predict and run every Q,
each plan built ``--rounds`` times, interleaved.

1. the layers are profiled (the loss too) at each micro-batch size the plans run, P's among them: with ``--pin``
   on every rank at once, pooled (:func:`side_by_side_profiles`), else on rank 0 alone
   (``sw.runtime.profile_sizes``) and handed round; every rank probes the replicas' all-reduce link
   (:func:`~stagewise.runtime.measure.links.all_reduce_link`, each group alone where the replicas share a machine:
   :func:`reduce_probe`; P is dp 1 and holds none), the point-to-point bandwidth (:func:`prior_bandwidth`, kept
   where P's transfers, all one size, cannot identify it) and, across machines, a message's CPU on the link
   (:func:`message_cpu`);
2. each round: every Q of :func:`.space.held_out` built afresh, ``--warmup`` untimed and ``--steps`` timed
   steps (each from a barrier, the slowest rank's ``train_step``), the order of the Qs reversed every other
   round, so that a drift of the machine falls on every plan alike; before every ``--p-every`` Qs, P built
   afresh and run under a :class:`~stagewise.runtime.RunCalibrator` (2 warm-up and 3 calibrating steps, each
   timed as every Q is, ``per_action`` and the probed all-reduce link: the runtime's calibration is the
   ``after`` model's, :func:`calibrate_round`), so that P's level is read across the whole sweep;
3. the predictions: each model of :mod:`.model` calibrated on all of P's runs pooled (its timelines and
   timed steps; nothing of any Q enters), and, for comparison with a one-build benchmark, on P's first build alone
   (``"first"``, made before any Q ran).

``--pin``: each rank on its own core (:func:`stagewise.runtime.measure.cores.pin_local_rank`, what ``stagewise
run --pin-cores`` does), against the between-build spread (which core a rank lands on, and whether two land on
one, changes from build to build); refused where the ranks outnumber the cores (``__main__`` passes it only to
the jobs that fit).
Rank 0 writes every plan's predictions, intervals and steps per build as JSON (``--out``), and what an offline
refit needs (``kept``: the profiles, P's timelines and timed steps of every round, cut, cores and links).
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import stagewise as sw
from stagewise.partition import stage_counts
from stagewise.planning import Calibration, Link
from stagewise.runtime import RunCalibrator

# internal: --pin, the pinning stagewise run --pin-cores does (the benchmark launches torchrun itself); the link
# probes alone (calibrate() probes much else): the ping-pong for the point-to-point bandwidth's prior, the
# replicas' all-reduce for their SYNC, a message's CPU on the link between machines; the profile's fastest round
# per layer (side_by_side_profiles)
from stagewise.runtime.measure.cores import pin_local_rank
from stagewise.runtime.measure.links import all_reduce_cpu, all_reduce_link, link_cpu, ping_pong
from stagewise.runtime.measure.profiling import fastest

from .._launch import timed_step
from ..fidelity.workloads import workloads
from . import builds, peaks
from .groups import released
from .model import calibrations, kept, nodes_of, predictions
from .space import GLOBAL_BATCH, PlanSpec, calibrating, held_out

#: P is built and calibrated again before every this many Qs: the calibration sets the level of every prediction
#: in the job, and P measured at three moments (once a round) carried a burst of the machine into all of them
#: (the 2026-12-06 run: P's three builds 517 / 398 / 342 ms, every prediction of the job 7 % high)
P_EVERY = 8


def alone_profiles(work: Any, x: Any, y: Any, sizes: Any) -> dict[int, sw.LayerProfile]:
    """The layers profiled alone on rank 0 at each micro-batch size of ``sizes`` (samples), in turns
    (``sw.runtime.profile_sizes``: the sizes' ratio moves every prediction at another micro-batch than P's),
    handed round."""
    text: list[Any] = [None]
    if dist.get_rank() == 0:
        model = sw.build_model(work.layers(), seed=0)
        got = sw.runtime.profile_sizes(model, x, sizes, repeats=5, warmup=2, rounds=3, loss_fn=work.loss, targets=y)
        text = [{b: p.to_json() for b, p in got.items()}]
    dist.broadcast_object_list(text, 0)
    return {int(b): sw.LayerProfile.from_json(t) for b, t in text[0].items()}


#: a layer's times, pooled over the ranks by :func:`side_by_side_profiles` (its bytes are the same on every rank)
TIMES = ("forward", "backward", "backward_input", "backward_weight", "checkpoint_forward", "checkpoint_backward")


def side_by_side_profiles(work: Any, x: Any, y: Any, sizes: Any, rounds: int = 3) -> dict[int, sw.LayerProfile]:
    """The layers profiled on every rank at once, each on its own core (``--pin``), each size's turn started
    together (a barrier; the order reversed each round, as ``profile_sizes`` takes them), each layer's fastest
    round per rank, then each time the mean over the ranks: the sizes' costs as the layers run beside each other
    in the pipeline (the other rank's memory traffic, the shared cache), in every process that runs them.
    2026-12-06: the 2-process jobs' 4-sample plans missed the 2-sample ones by a job's own 1-6 %, the same in
    each of the job's three rounds, where rank 0 alone had profiled the sizes' ratio."""
    model = sw.build_model(work.layers(), seed=0)
    wanted = sorted(set(sizes))
    runs: dict[int, list[sw.LayerProfile]] = {b: [] for b in wanted}
    for r in range(rounds):
        for b in wanted if r % 2 == 0 else wanted[::-1]:
            dist.barrier()
            got = sw.runtime.profile_sizes(model, x, [b], repeats=5, warmup=2, rounds=1, loss_fn=work.loss, targets=y)
            runs[b].append(got[b])
    mine = {b: fastest(runs[b]).to_json() for b in wanted}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    out = {}
    for b in wanted:
        each = [sw.LayerProfile.from_json(e[b]) for e in everyone]
        layers = tuple(
            replace(costs[0], **{f: sum(getattr(c, f) for c in costs) / len(costs) for f in TIMES})
            for costs in zip(*(p.layers for p in each))
        )
        out[b] = replace(each[0], layers=layers)
    return out


def micro_batch(plan: PlanSpec) -> int:
    return GLOBAL_BATCH // (plan.dp * plan.microbatches)


def probes(bandwidth: tuple[float, float]) -> Calibration:
    """The two prior bandwidths (:func:`prior_bandwidth`) as the runtime's calibrator takes them: the inter link
    between machines, the intra link inside one (their latencies unused: the run's transfers give those)."""
    between, inside = bandwidth
    return Calibration(intra=Link(0.0, inside), inter=Link(0.0, between))


def reduce_probe() -> tuple[float, float, float] | None:
    """The replicas' all-reduce link ``(latency, bandwidth, cpu)``: where a dp 2 plan's replicas share a machine
    (one machine, or an even number of processes on each: dp is the mesh's innermost axis), each group timed
    alone, and ``cpu`` the share of its SYNC that is CPU work on the shared cores (:func:`all_reduce_cpu`, every
    process of the job contending for this machine's cores: the namespace machines share them), else 0 (a wait).
    2026-12-06: the dp 2 plans ran 34-43 ms of CPU a step beyond the dp 1 ones at 4 processes, and were predicted
    5-8 % low with their SYNCs as waits."""
    per = per_machine()
    alone = per is None or per % 2 == 0
    link = all_reduce_link(2, alone=alone)
    if link is None:
        return None
    cpu = all_reduce_cpu(2, sharing=dist.get_world_size() / len(os.sched_getaffinity(0))) if alone else 0.0
    return link.latency, link.bandwidth, 0.0 if cpu is None else cpu


def calibrate_round(
    work: Any,
    p_plan: PlanSpec,
    profile: sw.LayerProfile,
    bandwidth: tuple[float, float],
    reduce: Any,
    steps: int = 0,
    share: float = 0.0,
) -> dict[str, Any]:
    """P built and run until its :class:`RunCalibrator` (the ``after`` model: ``per_action``, the probed
    all-reduce link, each step timed, ``share``: :func:`message_cpu`) calibrates, then ``steps`` more timed: the
    record, the calibrating timelines, every timed step after the warm-up, and P's cut and schedule."""
    x, y = work.data(GLOBAL_BATCH)
    with released():
        pipe = build(work, p_plan, profile, x[: micro_batch(p_plan)])
        calibrator = RunCalibrator(pipe, profile, processes=dist.get_world_size(), bandwidth=probes(bandwidth),
                                   per_action=True, reduce=reduce and reduce[:2],
                                   reduce_cpu=float(reduce[2]) if reduce and len(reduce) > 2 else 0.0,
                                   link_cpu=share)  # fmt: skip
        seen, timed = [], []
        while calibrator.calibration is None:
            timed.append(timed_step(pipe, x, y))
            seen.append(pipe.timeline(gather=True))
            calibrator.observe(seen[-1], step_s=timed[-1])
        timed += [timed_step(pipe, x, y) for _ in range(steps)]
        w = calibrator.warmup
        out = {"record": calibrator.records[0], "timelines": seen[w:], "steps": timed[w:],
               "schedule": pipe.schedule, "counts": [len(r) for r in pipe.layer_ranges],
               "cores": calibrator.cores, "affinity": calibrator.records[0]["affinity"],
               "tied": [list(t) for t in pipe.tied.layer_sets]}  # fmt: skip
        del pipe, calibrator
    return out


def calibrated(
    work: Any, p_plan: PlanSpec, profiles: dict[int, sw.LayerProfile], steps: int = 5
) -> tuple[Any, dict[str, Any], dict]:
    """One build of P (:func:`calibrate_round`, ``steps`` more timed): its calibrator's record, the models'
    calibrations (:func:`.model.calibrations`) of its timelines and timed steps, and what a refit needs."""
    b_p, bandwidth, reduce, share = micro_batch(p_plan), prior_bandwidth(), reduce_probe(), message_cpu()
    got = calibrate_round(work, p_plan, profiles[b_p], bandwidth, reduce, steps, share)
    return got["record"], *pooled(profiles, p_plan, [got], bandwidth, reduce, share)


def pooled(
    profiles: dict[int, sw.LayerProfile],
    p_plan: PlanSpec,
    rounds: list[dict],
    bandwidth: tuple[float, float],
    reduce: Any,
    share: float = 0.0,
) -> tuple[dict[str, Any], dict]:
    """The models calibrated on the P runs of ``rounds`` pooled (their calibrating timelines and timed steps),
    and the ``kept`` record (``rounds``: how many timelines and steps each round gave)."""
    timelines = [t for r in rounds for t in r["timelines"]]
    steps = [s for r in rounds for s in r["steps"]]
    first, world, per = rounds[0], dist.get_world_size(), per_machine()
    cals = calibrations(timelines, first["schedule"], profiles[micro_batch(p_plan)], first["counts"], first["cores"],
                        bandwidth[0], reduce, steps, first["affinity"], nodes_of(p_plan.pp, world, per),
                        first["tied"], bandwidth[1], share)  # fmt: skip
    keep = kept(profiles, timelines, p_plan._asdict(), first["counts"], first["cores"], bandwidth[0], world, reduce,
                steps, first["affinity"], per, first["tied"], bandwidth[1], share)  # fmt: skip
    keep["rounds"] = [[len(r["timelines"]), len(r["steps"])] for r in rounds]
    return cals, keep


def predicted_row(cals: dict, profiles: dict[int, sw.LayerProfile], p_plan: PlanSpec, plan: PlanSpec, q: Any) -> dict:
    """Q's predictions by each model of :mod:`.model`: the ``after`` model's as ``predicted`` / ``low`` /
    ``high`` (what the figures judge), the others' under their names (``"before"``, ``"at batch"``)."""
    counts = [len(r) for r in q.layer_ranges]
    got = predictions(cals, profiles, micro_batch(p_plan), q.schedule, counts, micro_batch(plan), plan.dp,
                      dist.get_world_size(), per_machine())  # fmt: skip
    others = {m: {"predicted": p.step, "low": p.low, "high": p.high} for m, p in got.items() if m != "after"}
    after = got["after"]
    return {"plan": plan._asdict(), "name": plan.describe(), "counts": counts, "virtual": virtual(plan.schedule),
            "predicted": after.step, "low": after.low, "high": after.high, **others}  # fmt: skip


def per_machine() -> int | None:
    """Processes per machine where the job spans machines (torchrun's ``LOCAL_WORLD_SIZE`` below the world), else
    None: the models then fit the link between machines apart from the one inside each (:func:`.model.nodes_of`)."""
    per = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    return per if 0 < per < dist.get_world_size() else None


def message_cpu() -> float:
    """The share of a core a message between the machines takes at each end while on the link
    (:func:`link_cpu`: rank 0 and the next machine's first rank); 0 on one machine. 2026-12-06: over 100 Mbit/s
    the compute ran 26-57 % slower than over the veth (1F1B to ZB-V at 8 micro-batches), and interleaved 1F1B was
    predicted 19 % low."""
    per = per_machine()
    return link_cpu(0, per) if per else 0.0


def prior_bandwidth() -> tuple[float, float]:
    """Bytes/s between machines and inside one (ping-pongs, 3 rounds: rank 0 with the first rank of the next
    machine, and with rank 1): the bandwidths the calibration keeps where P's transfers, all one size, cannot
    identify them (:mod:`stagewise.planning.link_fit`). On one machine, ranks 0 and 1's for both. Until
    2026-12-05 20:00 ranks 0 and 1's stood for both at 4 processes too: loopback, 4.2 GB/s, kept for a 100 Mbit
    link."""
    if dist.get_world_size() < 2:
        return float("inf"), float("inf")
    inside = ping_pong(0, 1, rounds=3, timeout=300).bandwidth
    per = per_machine()
    between = ping_pong(0, per, rounds=3, timeout=300).bandwidth if per else inside
    return between, inside


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


def build(work: Any, plan: PlanSpec, profile: sw.LayerProfile, sample: Any, **options: Any) -> sw.Pipeline:
    v = virtual(plan.schedule)
    parallel = sw.ParallelConfig(pp=plan.pp, dp=plan.dp) if plan.dp > 1 else None
    return sw.Pipeline(
        work.layers(), loss_fn=work.loss, schedule=plan.schedule, microbatches=plan.microbatches,
        virtual_stages=v, partition=counts_for(plan, work.layers(), profile, v or 1), sample_inputs=sample,
        parallel=parallel, seed=0, timeout=600, **options,
    )  # fmt: skip


def measured_builds(
    work: Any, plans: list[PlanSpec], order: list[int], profile: sw.LayerProfile, args: Any
) -> dict[int, Any]:
    """The plans ``order`` names, in that order, each built afresh, ``--warmup`` untimed and ``--steps`` timed
    steps: per plan index, ``(what the predictions read of its pipeline, its steps)``."""
    x, y = work.data(GLOBAL_BATCH)
    out = {}
    for k in order:
        with released():
            q = build(work, plans[k], profile, x[: micro_batch(plans[k])])
            for _ in range(args.warmup):
                timed_step(q, x, y)
            out[k] = (_Cut(q), [timed_step(q, x, y) for _ in range(args.steps)])
            del q
    return out


class _Cut:
    """What :func:`predicted_row` reads of a built pipeline (its cut and schedule), kept after it is gone."""

    def __init__(self, pipe: Any) -> None:
        self.layer_ranges, self.schedule = list(pipe.layer_ranges), pipe.schedule


def run(args: argparse.Namespace) -> dict[str, Any]:
    world = dist.get_world_size()
    work = workloads()[args.workload]
    x, y = work.data(GLOBAL_BATCH)
    p_plan, plans = calibrating(world), held_out(world, args.plans)
    sizes = [micro_batch(p) for p in (p_plan, *plans)]
    side_by_side = args.pin  # each rank on a core of its own (__main__ pins only the jobs that fit)
    profiles = (side_by_side_profiles if side_by_side else alone_profiles)(work, x, y, sizes)
    b_p, bandwidth, reduce, share = micro_batch(p_plan), prior_bandwidth(), reduce_probe(), message_cpu()
    p_rounds: list[dict[str, Any]] = []
    builds: list[list[list[float]]] = [[] for _ in plans]
    cuts: list[_Cut | None] = [None] * len(plans)
    first_cals: dict[str, Any] = {}
    for r in range(args.rounds):
        order = list(range(len(plans)))[:: -1 if r % 2 else 1]  # reversed every other round: a drift falls on all
        for start in range(0, len(order), args.p_every):
            p_rounds.append(calibrate_round(work, p_plan, profiles[b_p], bandwidth, reduce, share=share))
            if len(p_rounds) == 1:  # the one-build benchmark's calibration, before any Q runs
                first_cals = pooled(profiles, p_plan, p_rounds, bandwidth, reduce, share)[0]
            chunk = order[start : start + args.p_every]
            for k, (seen, steps) in measured_builds(work, plans, chunk, profiles[b_p], args).items():
                cuts[k] = cuts[k] or seen
                builds[k].append(steps)
    cals, keep = pooled(profiles, p_plan, p_rounds, bandwidth, reduce, share)
    rows = []
    for k, plan in enumerate(plans):
        q = cuts[k]
        first = predicted_row(first_cals, profiles, p_plan, plan, q)
        row = predicted_row(cals, profiles, p_plan, plan, q)
        steps = [s for b in builds[k] for s in b]
        once = {"predicted": first["predicted"], "low": first["low"], "high": first["high"]}
        rows.append({**row, "builds": builds[k], "steps": steps, "first": once})
    record, own, first = p_rounds[0]["record"], first_cals["after"], p_rounds[0]
    p_nodes = nodes_of(p_plan.pp, world, per_machine())
    tied = own.tied_sums(first["counts"], first["schedule"], p_plan.dp, p_nodes)
    again = own.predict(first["schedule"], own.profile(profiles[b_p]).cost_model(_bounds(first["counts"])), world,
                        p_nodes, tied=tied).step  # fmt: skip
    return {
        "workload": args.workload, "world": world, "rounds": args.rounds, "pin": args.pin,
        "profiled": "side by side" if side_by_side else "alone",
        "calibrating": p_plan._asdict(), "calibration": record, "records": [p["record"] for p in p_rounds],
        "runtime against the after model": record["predicted_s"] / again - 1,
        "p_builds": [p["steps"] for p in p_rounds], "overhead_s": cals["after"].overhead,
        "bias_after": cals["after"].bias, "plans": rows, "kept": keep,
        "threads at end": len(os.listdir("/proc/self/task")),  # the groups let go (.groups): ~10, not ~1500
    }  # fmt: skip


def _bounds(counts: list[int]) -> list[int]:
    out = [0]
    for c in counts:
        out.append(out[-1] + c)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workload", default="gpt256")
    parser.add_argument("--plans", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="builds of every Q, interleaved")
    parser.add_argument("--p-every", type=int, default=P_EVERY, help="P built and calibrated again before every N Qs")
    parser.add_argument("--pin", action="store_true", help="each rank on its own core (stagewise run --pin-cores)")
    parser.add_argument("--builds", action="store_true", help="P built again and again instead (:mod:`.builds`)")
    parser.add_argument("--peaks", action="store_true", help="the activation peaks instead (:mod:`.peaks`)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.pin:  # before torch starts a thread: they inherit it
        pin_local_rank()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        if args.builds or args.peaks:
            result = (builds if args.builds else peaks).run(args, build, alone_profiles)
        else:
            result = run(args)
        if dist.get_rank() == 0:
            args.out.write_text(json.dumps(result, default=str))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
