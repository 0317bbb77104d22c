"""One rank of ``python -m benchmarks.plan_accuracy``: profile, measure the link, plan, run chosen plans, time them.

Rank 0 profiles the layers at micro-batch sizes b and 8b alone (the others
wait), and the two sizes give each layer a fixed part and a part linear in
the batch. ``sw.calibrate()`` measures the link, the runtime's cost per action
and FSDP2's cost per unit on the group, ``sw.runtime.measure_compute_scale()`` what the
runtime's compute actions cost over the plan's costs for them. Each rank then
plans alike three times - with the calibration, the compute scale and the
calibration's cores; as round 5 did ("before": no scale, the cores measured on
the model's own work); bare (profile and link only) - runs the plans chosen
from the first ranking (the top ones, a spread of poorer ones, and each layout's
best), times them as the planner predicts a step (back to back: see
:func:`time_plans`), times each plan that misses by more than 15 % again (the
repeat a miss is judged against) and predicts it again without each term of the
model in turn (:func:`ablations`), and rank 0 writes JSON with the predictions.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import stagewise as sw
from stagewise.partition import LayerProfile
from stagewise.planning import search
from stagewise.runtime import build_mesh, measure_compute_scale

# internal: the planner's inputs measured again under this run's conditions, which sw.calibrate() measures only
# under its own: the idle CPU once the chosen plans' meshes exist, the cores on the model's own work (not its
# fixed probe); and the very plan sw.runtime.measure_compute_scale() will run, to hand it a mesh shared with the timed
# plans. No public name offers these three.
from stagewise.runtime.calibration.calibrate import effective_cores, idle_cpu
from stagewise.runtime.calibration.compute_scale import probe_plan

from .misses import MISS, ablations
from .models import MODELS

PROFILE_ROUNDS = 3


def core_speed(rank: int, rounds: int = 5) -> float:
    """CPU seconds rank 0 spends on a fixed workload (small matmuls and tanh, one thread, ~7 ms) while the others
    wait: the median of ``rounds``. Taken around the probe and around each round of the plans' timing, the two
    means say whether a core did the same work at the same speed in both (a host's other tenants, invisible as
    steal, change it; one reading is a moment: two taken before the probe and after the timing moved 0.75-1.47x
    without following the runs' bias)."""
    spent = [0.0]
    if rank == 0:
        a = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
        times = []
        for _ in range(rounds):
            start, x = time.thread_time(), a
            for _ in range(300):
                x = torch.tanh(x @ a * 0.1)
            times.append(time.thread_time() - start)
        spent = [statistics.median(times)]
    dist.broadcast_object_list(spent, 0)
    return float(spent[0])


def alone_profiles(layers: list[sw.Layer], sample: Any, small: int, rank: int) -> tuple[LayerProfile, LayerProfile]:
    """Rank 0 profiles while the others wait (a core to itself: the planner's ``cores`` models the sharing) at
    ``small`` samples and at all of ``sample``'s, in turns (``sw.runtime.profile_sizes``), :data:`PROFILE_ROUNDS`
    rounds, each layer from its fastest (three profiles of the MLP in one 4-rank run, one after another, gave
    its per-sample forward 37 / 50 / 53 us)."""
    text: list[Any] = [None]
    if rank == 0:
        model = sw.build_model(layers, seed=0)  # the layers as a pipeline builds them, each one timed on its own
        big = len(sample)
        got = sw.runtime.profile_sizes(model, sample, [small, big], repeats=7, warmup=2, rounds=PROFILE_ROUNDS)
        text = [(got[small].to_json(), got[big].to_json())]
    dist.broadcast_object_list(text, 0)
    return LayerProfile.from_json(text[0][0]), LayerProfile.from_json(text[0][1])  # type: ignore[index]


SPAN = 8  # the large profile holds SPAN times the small one's samples: the fit spans the plans' micro-batch sizes


def affine(small: LayerProfile, big: LayerProfile, span: int = SPAN) -> tuple[LayerProfile, list[float]]:
    """Per layer: the part linear in the batch (for the small profile's ``b`` samples: ``(big - small) / (span - 1)``)
    and the fixed part (``small`` less that). Measured at b and ``span * b`` samples, so the line is exact at both
    ends of the range the plans use (b = 2 and 16 samples for the GPT, whose cost per sample grows past b = 4)."""
    fixed, linear = [], []
    k = span - 1
    for a, b in zip(small.layers, big.layers):
        slope = lambda x, y: max((y - x) / k, 1e-9)  # noqa: E731
        fix_f = max(0.0, a.forward - slope(a.forward, b.forward))
        fix_b = max(0.0, a.backward - slope(a.backward, b.backward))
        fixed.append((fix_f + fix_b) / 2)
        linear.append(
            replace(
                a,
                forward=slope(a.forward, b.forward),
                backward_input=slope(a.backward_input, b.backward_input),
                backward_weight=slope(a.backward_weight, b.backward_weight),
                backward=slope(a.backward, b.backward),
            )
        )
    return replace(small, layers=tuple(linear)), fixed


def choose(plans: list[sw.Plan], count: int, per_layout: bool = False) -> list[tuple[int, sw.Plan]]:
    """The top 3, then ``count - 3`` spread over the rest down to the worst; with ``per_layout`` also each layout's
    best plan (so that data-parallel and sharded layouts are timed, not only the pipelines that rank first)."""
    picks = list(range(min(3, len(plans))))
    rest = list(range(3, len(plans)))
    if rest and count > 3:
        step = max(1, len(rest) // (count - 3))
        picks += rest[::step][: count - 4] + [rest[-1]]
    if per_layout:
        firsts: dict[sw.ParallelConfig, int] = {}
        for k, plan in enumerate(plans):
            firsts.setdefault(plan.layout, k)
        picks += sorted(set(firsts.values()) - set(picks))
    return [(k, plans[k]) for k in dict.fromkeys(picks)]


MESHES: dict[sw.ParallelConfig, sw.Mesh] = {}  # every model's plans share them


def mesh_per_layout(plans: list[sw.Plan]) -> dict[sw.ParallelConfig, sw.Mesh]:
    """One mesh per layout, shared by that layout's pipelines (both models'): a gloo group's polling thread lives
    as long as the run, and the many groups of a mesh per pipeline would take CPU from every step timed after
    them."""
    for plan in plans:
        if plan.layout not in MESHES:
            MESHES[plan.layout] = build_mesh(plan.layout)
    return MESHES


def model_cores(layers: list[sw.Layer], loss_fn: Any, data: Any, b0: int, world: int, default: float | None) -> float:
    """The cores the ranks share on this model's own work: its forward and backward at ``SPAN // 2`` times the
    profiled micro-batch (the middle of the plans' sizes), alone and on every rank at once
    (``COMPUTE_CORES=matmul`` keeps the calibration's cache-resident probe)."""
    if os.environ.get("COMPUTE_CORES") == "matmul":
        return float(default or world)
    model = sw.build_model(layers, seed=0)
    x, y = data(SPAN // 2 * b0, 7)

    def work() -> None:
        loss_fn(model(x), y).backward()

    return effective_cores(world, work=work, rounds=15, timeout=120)


ROUNDS = 3  # each plan's timed steps are split into this many rounds, the plans taking turns


def time_plans(
    plans: list[sw.Plan], model: str, steps: int, speed: Callable[[], float]
) -> tuple[list[dict[str, Any]], list[float]]:
    """Each plan's step time measured as the planner predicts it, and from a barrier; then one metered step each.

    The prediction is the time per step of steps run back to back (see :class:`stagewise.Plan`): ``measured``
    is the median over the timed steps of the slowest rank's seconds from the end of its previous step to the
    end of this one. ``measured_barrier`` times each step alone from a barrier (how earlier rounds measured:
    it adds the skew of leaving the barrier and the cold start of every step). The plans take turns: ``steps``
    timed steps per plan and way in :data:`ROUNDS` rounds, every plan once per round, so a load that comes and
    goes on this shared machine weighs on every plan alike rather than on whichever ran then. Each turn starts
    with untimed steps (two in the first round). ``cpu_busiest`` / ``cpu_total``: the busiest rank's CPU seconds
    in a back-to-back step, and every rank's summed. ``speed()`` is read before each round and after the last.
    """
    make, loss_fn, data, batch, _ = MODELS[model]
    meshes = mesh_per_layout(plans)
    pipes = [
        sw.Pipeline.from_plan(plan, make(), loss_fn=loss_fn, seed=0, timeout=120, parallel=meshes[plan.layout])
        for plan in plans
    ]
    per_round = -(-steps // ROUNDS)
    batches = [data(batch, k) for k in range(per_round + 2)]
    rows: list[dict[str, list[float]]] = [{"wall": [], "busiest": [], "total": [], "barrier": []} for _ in plans]
    rounds: list[list[float]] = [[] for _ in plans]  # each round's median back-to-back step
    speeds = []
    for round_ in range(ROUNDS):
        speeds.append(speed())
        warm = 2 if round_ == 0 else 1  # each turn starts warm, as a run of one plan does
        for k, pipe in enumerate(pipes):
            wall, busiest, total = back_to_back(pipe, batches[: warm + per_round], warm)
            rows[k]["wall"] += wall
            rows[k]["busiest"] += busiest
            rows[k]["total"] += total
            rows[k]["barrier"] += [_barrier_step(pipe, *b) for b in batches[:per_round]]
            rounds[k].append(statistics.median(wall))
    speeds.append(speed())
    out = []
    for plan, row, medians in zip(plans, rows, rounds):
        out.append(
            {
                "measured": statistics.median(row["wall"]),
                "measured_barrier": statistics.median(row["barrier"]),
                "runs": len(row["wall"]),
                "round_medians": medians,
                "measured_activations": _metered_peak(plan, model, meshes[plan.layout]),
                "cpu_busiest": statistics.median(row["busiest"]),
                "cpu_total": statistics.median(row["total"]),
            }
        )
    return out, speeds


def back_to_back(
    pipe: sw.Pipeline, batches: list[tuple[torch.Tensor, torch.Tensor]], warm: int
) -> tuple[list[float], list[float], list[float]]:
    """Train on ``batches`` one step after another (the first ``warm`` untimed); per timed step: the slowest rank's
    seconds since its previous step ended, the busiest rank's CPU seconds and every rank's summed."""
    inputs = [pipe.local_batch(x, y) for x, y in batches]
    dist.barrier()
    for b in inputs[:warm]:
        pipe.train_step(*b)
    wall, cpu = [], []
    t, c = time.perf_counter(), time.process_time()
    for b in inputs[warm:]:
        pipe.train_step(*b)
        t2, c2 = time.perf_counter(), time.process_time()
        wall.append(t2 - t)
        cpu.append(c2 - c)
        t, c = t2, c2
    slowest, busiest, total = torch.tensor(wall), torch.tensor(cpu), torch.tensor(cpu)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    dist.all_reduce(busiest, op=dist.ReduceOp.MAX)
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return slowest.tolist(), busiest.tolist(), total.tolist()


def _barrier_step(pipe: sw.Pipeline, x: torch.Tensor, y: torch.Tensor) -> float:
    """One train step from a barrier: the slowest rank's seconds."""
    inputs = pipe.local_batch(x, y)
    dist.barrier()
    t = time.perf_counter()
    pipe.train_step(*inputs)
    elapsed = torch.tensor([time.perf_counter() - t])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed[0])


def _metered_peak(plan: sw.Plan, model: str, mesh: sw.Mesh) -> float:
    """The most activation bytes any rank holds in one step of ``plan``, measured (the meter's hooks cost time)."""
    make, loss_fn, data, batch, _ = MODELS[model]
    metered = sw.Pipeline.from_plan(
        plan, make(), loss_fn=loss_fn, seed=0, measure_memory=True, timeout=120, parallel=mesh
    )
    metered.train_step(*metered.local_batch(*data(batch, 0)))
    peak = torch.tensor([float(metered.memory_report()["peak_bytes"])])
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return float(peak)


def _chosen(
    found: Any, count: int, earlier: dict | None, model: str, per_layout: bool = False
) -> list[tuple[int, sw.Plan]]:
    """The plans to time, with their place in this run's ranking: :func:`choose`'s, or an earlier run's."""
    if earlier is None:
        return choose(list(found.plans), count, per_layout)
    where = {p.describe(): (k, p) for k, p in enumerate(found.plans)}  # the plans an earlier run timed, ranked anew
    wanted = [r["plan"] for r in earlier["models"][model]["rows"]]
    missing = [name for name in wanted if name not in where]
    if missing:
        raise SystemExit(f"--same-plans: {model} plans {missing} are not among this run's {len(where)}")
    return [where[name] for name in wanted]


def _row(k: int, first: sw.Plan, plan: sw.Plan, timed: dict[str, Any], before: dict, bare: dict) -> dict[str, Any]:
    """One timed plan: its predictions (now, at the calibration, round 5's, bare) and what was measured."""
    row: dict[str, Any] = {"rank": k + 1, "plan": plan.describe(), "predicted": plan.step_time}
    row["kind"] = layout_kind(plan.layout)
    row["predicted_at_calibration"] = first.step_time
    row["predicted_before"] = before[plan.describe()].step_time if plan.describe() in before else None
    row["bare"] = bare[plan.describe()].step_time if plan.describe() in bare else None
    row["cpu_bound"] = max(plan.breakdown["cpu_bound"], plan.breakdown["shared_cores"]) > plan.breakdown["simulated"]
    row["predicted_activations"] = max(m.activations for m in plan.memory)
    row["compute_busiest"] = plan.breakdown["compute"]
    row["breakdown"] = dict(plan.breakdown)
    bd = plan.breakdown
    row["fixed_step"] = plan.step_time - max(bd["simulated"], bd["cpu_bound"], bd["shared_cores"])
    row.update(timed)
    return row


def layout_kind(layout: sw.ParallelConfig) -> str:
    """``"sharded"`` (sharding > 1), ``"data-parallel"`` (dp > 1), ``"tensor-parallel"`` or ``"pipeline"`` only."""
    if layout.sharding > 1:
        return "sharded"
    if layout.dp > 1:
        return "data-parallel"
    return "tensor-parallel" if layout.tp > 1 else "pipeline"


def measure_model(
    model: str, profile: tuple[LayerProfile, list[float]], cal: Any, args: argparse.Namespace, earlier: dict | None
) -> dict[str, Any]:
    """Plan one model (calibrated and scaled; round 5's way; bare), time the chosen plans: its part of the report."""
    make, loss_fn, data, batch, b0 = MODELS[model]
    rank, world = dist.get_rank(), dist.get_world_size()
    linear, fixed = profile
    cores = model_cores(make(), loss_fn, data, b0, world, cal.cores)
    common: dict[str, Any] = {"global_batch": batch, "profile_batch": b0, "overhead": fixed, "optimizer_state": 0}
    probing = [core_speed(rank)]
    # the runtime's compute per action on this group against the plan's costs for it, where every rank computes
    probe = probe_plan(linear, world, calibration=cal, **common)
    xs, ys = data(batch, 98)
    scale = measure_compute_scale(
        linear, make(), loss_fn, xs, ys, calibration=cal, parallel=mesh_per_layout([probe])[probe.layout], **common
    )
    probing.append(core_speed(rank))
    # every plan ranked: an earlier run's (--same-plans) or a layout's best may lie beyond the top 400
    found = search(linear, world, calibration=cal, compute_scale=scale, top=100_000, **common)
    bare = {p.describe(): p for p in search(linear, world, intra=cal.intra, top=100_000, **common).plans}
    chosen = _chosen(found, args.plans, earlier, model, args.per_layout)
    # the chosen plans' meshes exist from here on, and their transport threads poll: the idle CPU is measured
    # again with them (calibrate() measured it with its own groups only) and the chosen plans predicted with it
    mesh_per_layout([plan for _, plan in chosen])
    background = idle_cpu(timeout=120)
    now = replace(cal, background=background)
    redone = search(linear, world, calibration=now, compute_scale=scale, top=100_000, **common).plans
    again = {p.describe(): p for p in redone}
    # round 5's model, for comparison in the same run: the cores measured on the model's work, no scale
    before = {p.describe(): p for p in search(linear, world, calibration=now, cores=cores, top=100_000, **common).plans}
    timings, timing = time_plans([plan for _, plan in chosen], model, args.steps, lambda: core_speed(rank))
    rows = [_row(k, first, again[first.describe()], timed, before, bare) for (k, first), timed in zip(chosen, timings)]
    missed = [k for k, row in enumerate(rows) if abs(row["predicted"] / row["measured"] - 1) > args.miss]
    if missed:  # each plan that misses, timed again: a miss is judged against how far its measurement moves
        repeats, _ = time_plans([chosen[k][1] for k in missed], model, args.steps, lambda: core_speed(rank))
        for k, timed in zip(missed, repeats):
            rows[k]["measured_again"] = timed["measured"]
            rows[k]["round_medians_again"] = timed["round_medians"]
        without = ablations(linear, world, now, scale, common)
        for k in missed:
            name = rows[k]["plan"]
            rows[k]["without"] = {term: plans[name].step_time for term, plans in without.items() if name in plans}
    return {
        # the fixed workload's CPU seconds: the mean around the probe, the mean around the timing's rounds
        "core_seconds": [statistics.fmean(probing), statistics.fmean(timing)],
        "core_readings": {"probe": probing, "timing": timing},
        "candidates": found.candidates,
        "simulated": found.simulated,
        "rows": rows,
        "cores": cores,
        "compute_scale": list(scale),
        "background": background,
        "profile": linear.to_json(),  # what the planner was given: a saved report can be re-predicted
        "overhead": fixed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--plans", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--same-plans", type=Path, default=None)
    parser.add_argument("--per-layout", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--miss", type=float, default=MISS)
    args = parser.parse_args()
    unknown = [name for name in args.models.split(",") if name not in MODELS]
    if unknown:
        raise SystemExit(f"--models: unknown {unknown}; expected names from {list(MODELS)}")
    same = json.loads(args.same_plans.read_text()) if args.same_plans is not None else None
    torch.set_num_threads(1)
    env = sw.init(backend="gloo")
    # every model profiled first, before the calibration's or any plan's process groups exist (each gloo group's
    # thread wakes 100 times a second on every rank: the MLP's layers, 1-20 us each, profiled after the GPT's plans
    # varied 2x between runs)
    profiles = {}
    for model in dict.fromkeys(args.models.split(",")):
        make, _, data, _, b0 = MODELS[model]
        x, _ = data(SPAN * b0, 99)
        profiles[model] = affine(*alone_profiles(make(), x, b0, env.rank))
    cal = sw.calibrate(timeout=120)
    report: dict[str, Any] = {
        "world": env.world_size,
        "cores": cal.cores,
        "calibration": cal.to_dict(),
        "miss": args.miss,
        "models": {},
    }
    for model, profile in profiles.items():
        report["models"][model] = measure_model(model, profile, cal, args, same)
    if env.rank == 0:
        args.out.write_text(json.dumps(report, indent=1))
    dist.barrier()


if __name__ == "__main__":
    main()
