"""One rank of ``python -m benchmarks.fidelity``: profile, calibrate, run every schedule, meter it, predict it.

In order, on one workload and one rank count (the driver starts one torchrun job per pair):

1. rank 0 profiles the layers on one micro-batch while the others wait (``sw.profile``, its loss too), before
   any pipeline's or the calibration's process groups exist;
2. ``sw.calibrate()`` measures the link and the runtime's cost per action and per step (no sharding or layout
   probes: a pipeline only);
3. one Pipeline per schedule, none metered (the meter's hooks cost time); they take turns: ``--rounds``
   rounds, each running every schedule's untimed warm-up steps (``--warmup`` in the first round, one later)
   and then its share of ``--steps`` timed steps, so that a load which comes and goes weighs on every schedule
   alike. A timed step starts from a barrier; each rank records its ``train_step`` wall and CPU time and its
   step's timeline (:func:`.breakdown.step_record`); with ``--timelines`` every rank's timeline is also
   gathered (a collective, after the clock stopped) for the pictures;
4. per schedule, a metered twin (``measure_memory=True``, the same Schedule and cut) runs two steps: the
   second step's ``memory_report()`` on every rank;
5. rank 0 predicts each schedule on the cut it ran (:mod:`.predicted`) and writes everything as JSON.

Only names that the code before issue 39 has too are used on the measured side (Pipeline, ``schedule=``,
``measure_memory=``, ``memory_report``, ``timeline``, ``sw.profile``, ``sw.calibrate``), so the same worker
measures that code with its ``src`` first on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import stagewise as sw
from stagewise.planning import Link

from .breakdown import stage_means, step_record
from .predicted import bounds_of, predict, profile_costs, tied_of
from .workloads import Workload, workloads

AUTO = "auto"


def virtual_stages(name: str) -> int | None:
    """2 where the schedule takes virtual stages (a choice, or exactly 2), else its own default."""
    if name == AUTO:
        return None
    allowed = sw.schedule_info(name).virtual_stages
    return 2 if allowed is None or 2 in allowed else None


def alone_profile(work: Workload, x: Any, y: Any, args: argparse.Namespace) -> sw.LayerProfile:
    """Rank 0 profiles one micro-batch while the others wait; every rank gets the profile."""
    text: list[Any] = [None]
    if dist.get_rank() == 0:
        model = sw.build_model(work.layers(), seed=0)  # the layers as a pipeline builds them
        measured = sw.profile(
            model, x, repeats=args.repeats, warmup=2, rounds=args.profile_rounds, loss_fn=work.loss, targets=y
        )
        text = [measured.to_json()]
    dist.broadcast_object_list(text, 0)
    return sw.LayerProfile.from_json(text[0])


def measured_scale(args: argparse.Namespace, profile: sw.LayerProfile, work: Workload, cal: Any) -> tuple[float, ...]:
    """``measure_compute_scale``'s factors (F, B[, I + W]) at this workload's micro-batch, or () where
    ``--scale-steps 0`` skips it.

    Its probes run 2 micro-batches per rank; given the whole batch they would run micro-batches of
    ``microbatches / (2 ranks)`` times the profile's, and the planner's linear scaling from the profile's
    batch would put into the factor how much better a larger batch uses the core (measured on the d 256 GPT:
    0.93 there against 1.10-1.14 in the pipelines themselves). The probes get 2 micro-batches per rank of
    the profile's size instead, the pipelines' micro-batch."""
    if args.scale_steps == 0:
        return ()
    n = work.microbatch * 2 * dist.get_world_size()
    xs, ys = work.data(n)
    return tuple(
        sw.runtime.measure_compute_scale(
            profile, work.layers(), work.loss, xs, ys, steps=args.scale_steps, passes=args.passes,
            timeout=args.timeout, progress=False, global_batch=n, profile_batch=work.microbatch, calibration=cal,
        )
    )  # fmt: skip


def calibration(args: argparse.Namespace, profile: sw.LayerProfile, work: Workload) -> dict[str, Any]:
    """The link and the runtime's costs per action, message and step; the cores the ranks share; and the
    runtime's compute on the group over the profile's (``measure_compute_scale``: F, B, I + W), which holds
    what sharing caches and memory bandwidth with the other ranks costs a stage's compute."""
    cal = sw.calibrate(sharding=False, layouts=False, passes=args.passes, timeout=args.timeout, progress=False)
    link = cal.intra or cal.inter
    scale = measured_scale(args, profile, work, cal)
    return {
        "compute_scale": list(scale),
        "latency": link.latency if link else 0.0,
        "bandwidth": link.bandwidth if link and math.isfinite(link.bandwidth) else None,  # None: unlimited
        "action": float(getattr(cal, "action", 0.0)),
        "message": float(getattr(cal, "message", 0.0)),
        "step": float(getattr(cal, "step", 0.0)),
        "cores": getattr(cal, "cores", None),
        "background": float(getattr(cal, "background", 0.0)),
    }


def build(work: Workload, name: str | sw.Schedule, sample: Any, args: argparse.Namespace, **extra: Any) -> sw.Pipeline:
    """The pipeline of one schedule (a name, ``"auto"``, or a Schedule with ``partition=`` in ``extra``)."""
    options: dict[str, Any] = {"partition": args.partition, "microbatches": args.microbatches}
    if isinstance(name, str):
        options["virtual_stages"] = virtual_stages(name)
    if name == AUTO or args.partition in ("time", "memory"):
        options["sample_inputs"] = sample
    options.update(extra)
    if not isinstance(name, str):
        options.pop("microbatches")  # the Schedule's own count
    return sw.Pipeline(work.layers(), loss_fn=work.loss, schedule=name, seed=0, timeout=args.timeout, **options)


def timed_step(pipe: sw.Pipeline, x: Any, y: Any, gather: bool) -> tuple[dict[str, Any], Any]:
    """One step from a barrier: this rank's record, and (``gather``) every rank's timeline as JSON."""
    dist.barrier()
    c0, t0 = time.process_time(), time.perf_counter()
    pipe.train_step(x, y)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    events = [(str(e.action), e.start, e.end) for e in pipe.timeline().events]
    whole = pipe.timeline(gather=True).to_json() if gather else None
    return step_record(events, wall, cpu), whole


Records = dict[str, list[dict[str, Any]]]  # schedule -> one record per timed step


def say(started: float, what: str) -> None:
    """Rank 0's progress, into the job's log."""
    if dist.get_rank() == 0:
        print(f"{time.perf_counter() - started:7.1f} s  {what}", flush=True)


def take_turns(
    pipes: dict[str, sw.Pipeline], x: Any, y: Any, args: argparse.Namespace, done: Callable[[int], None]
) -> tuple[Records, dict[str, list[Any]]]:
    """Every schedule's timed steps, the schedules taking turns round by round: (records, gathered timelines)."""
    per_round = -(-args.steps // args.rounds)
    records: Records = {name: [] for name in pipes}
    timelines: dict[str, list[Any]] = {name: [] for name in pipes}
    for round_ in range(args.rounds):
        for name, pipe in pipes.items():
            for _ in range(args.warmup if round_ == 0 else 1):
                pipe.train_step(x, y)
            for _ in range(min(per_round, args.steps - len(records[name]))):
                record, whole = timed_step(pipe, x, y, args.timelines)
                records[name].append(record)
                timelines[name].append(whole)
        done(round_)
    return records, timelines


def metered(work: Workload, pipe: sw.Pipeline, x: Any, y: Any, args: argparse.Namespace) -> dict[str, Any]:
    """This rank's activation meter on the second step of a metered twin of ``pipe`` (same schedule and cut)."""
    counts = [len(r) for r in pipe.layer_ranges]
    twin = build(work, pipe.schedule, x, args, partition=counts, measure_memory=True)
    for _ in range(2):
        twin.train_step(x, y)
    report = twin.memory_report()
    twin.transport.close()

    def key(at: tuple[int, int]) -> str:
        return f"{at[0]},{at[1]}"

    return {
        "peak_bytes": report["peak_bytes"],
        "forward_bytes": {key(k): v for k, v in report["forward_bytes"].items()},
        "weight_bytes": {key(k): v for k, v in report.get("weight_bytes", {}).items()},
    }


def describe(pipe: sw.Pipeline) -> dict[str, Any]:
    s = pipe.schedule
    return {"schedule": s.name, "stages": s.num_stages, "microbatches": s.num_microbatches,
            "bounds": bounds_of(pipe.layer_ranges), "chosen": s.meta.get("auto")}  # fmt: skip


def gathered(value: Any) -> list[Any]:
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, value)
    return everyone


def predictions(
    profile: sw.LayerProfile, pipes: dict[str, sw.Pipeline], records: dict[str, list[Any]], cal: dict[str, Any]
) -> dict[str, Any]:
    """Rank 0's predictions of every schedule (:func:`.predicted.predict`) on the cut each pipeline ran."""
    cores = cal["cores"] if cal["cores"] is not None else float(os.cpu_count() or 1)
    out = {}
    for name, pipe in pipes.items():
        bandwidth = math.inf if cal["bandwidth"] is None else cal["bandwidth"]
        costs = profile_costs(profile, bounds_of(pipe.layer_ranges), cal["latency"], bandwidth)
        counts = [len(r) for r in pipe.layer_ranges]
        tied = tied_of(profile, pipe.tied.layer_sets, counts, pipe.schedule, Link(cal["latency"], bandwidth))
        out[name] = predict(pipe.schedule, costs, cal, cores, stage_means(records[name]), tied)
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Steps 1-5 of the module's docstring; the report (complete on rank 0)."""
    work = workloads()[args.workload]
    x, y = work.data(work.microbatch * args.microbatches)
    sample, targets = x[: work.microbatch], y[: work.microbatch]
    started = time.perf_counter()
    profile = alone_profile(work, sample, targets, args)
    say(started, "profiled")
    cal = calibration(args, profile, work)
    say(started, "calibrated")
    pipes = {name: build(work, name, sample, args) for name in args.schedules.split(",")}
    say(started, f"{len(pipes)} pipelines built")
    records, timelines = take_turns(pipes, x, y, args, lambda k: say(started, f"round {k + 1} of {args.rounds}"))
    memory = {name: metered(work, pipe, x, y, args) for name, pipe in pipes.items()}
    say(started, "metered")
    everyone = gathered({"records": records, "memory": memory})
    report: dict[str, Any] = {
        "workload": work.name,
        "title": work.title,
        "d_model": work.d_model,
        "ranks": dist.get_world_size(),
        "microbatch": work.microbatch,
        "microbatches": args.microbatches,
        "calibration": cal,
        "profile": profile.to_json(),
    }
    if dist.get_rank() == 0:
        per_rank = {name: [r["records"][name] for r in everyone] for name in pipes}
        sims = predictions(profile, pipes, per_rank, cal)
        report["schedules"] = {
            name: {**describe(pipe), "records": per_rank[name], "memory": [r["memory"][name] for r in everyone],
                   "predicted": sims[name], "timelines": [t for t in timelines[name] if t is not None]}
            for name, pipe in pipes.items()
        }  # fmt: skip
    report["seconds"] = time.perf_counter() - started
    for pipe in pipes.values():
        pipe.transport.close()
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--workload", required=True)
    parser.add_argument("--schedules", required=True, help="comma-separated names, 'auto' among them")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=7, help="the profile's repeats per layer")
    parser.add_argument("--profile-rounds", type=int, default=3)
    parser.add_argument("--passes", type=int, default=3, help="sw.calibrate()'s passes")
    parser.add_argument(
        "--scale-steps",
        type=int,
        default=6,
        help="measure_compute_scale's steps per pass (0: not measured, the planner's prediction at k = 1)",
    )
    parser.add_argument("--partition", default="uniform")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--timelines", action="store_true", help="gather every timed step's timeline (pictures)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    sw.init()
    report = run(args)
    if dist.get_rank() == 0:
        args.out.write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
