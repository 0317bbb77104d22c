"""One rank of ``python -m benchmarks.plan_accuracy``: profile, measure the link, plan, run chosen plans, time them.

Rank 0 profiles the layers at micro-batch sizes b and 8b alone (the others
wait), and the two sizes give each layer a fixed part and a part linear in
the batch. ``sw.calibrate()`` measures the link, the runtime's cost per action
and FSDP2's cost per unit on the group, ``sw.runtime.measure_compute_scale()`` what the
runtime's compute actions cost over the plan's costs for them. Each rank then
plans alike three times - with the calibration, the compute scale and the
calibration's cores; as round 5 did ("before": no scale, the cores measured on
the model's own work); bare (profile and link only) - runs the plans chosen
from the first ranking (warm-up, then timed steps: a step's time is the
slowest rank's, from a barrier), and rank 0 writes JSON with the predictions.
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
import torch.nn.functional as F
from torch import nn

import stagewise as sw
from stagewise.partition import LayerProfile
from stagewise.planning import search
from stagewise.runtime import build_mesh, measure_compute_scale

# internal: the planner's inputs measured again under this run's conditions, which sw.calibrate() measures only
# under its own: the idle CPU once the chosen plans' meshes exist, the cores on the model's own work (not its
# fixed probe); and the very plan sw.runtime.measure_compute_scale() will run, to hand it a mesh shared with the timed
# plans. No public name offers these three.
from stagewise.runtime.measure.calibrate import effective_cores, idle_cpu
from stagewise.runtime.measure.compute_scale import probe_plan

from .._examples import example

_gpt = example("gpt_model")
Block, GPTConfig, Positions = _gpt.Block, _gpt.GPTConfig, _gpt.Positions

GPT = GPTConfig(vocab_size=256, seq_len=64, d_model=64, n_heads=4, n_layers=6)


def gpt_layers() -> list[sw.Layer]:
    """The demo GPT (examples/gpt_model.py) with an untied head: the planner does not model tied weights."""
    c = GPT
    return (
        [sw.Layer(nn.Embedding, c.vocab_size, c.d_model), sw.Layer(Positions, c)]
        + [sw.Layer(Block, c) for _ in range(c.n_layers)]
        + [sw.Layer(nn.LayerNorm, c.d_model), sw.Layer(nn.Linear, c.d_model, c.vocab_size)]
    )


def gpt_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def gpt_data(batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, GPT.vocab_size, (batch, GPT.seq_len + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


WIDTHS = [64, 512, 64, 64, 1024, 64, 64, 64, 256, 64, 64, 64]


def mlp_layers() -> list[sw.Layer]:
    """Linear + GELU pairs whose hidden widths differ 16-fold: stage costs are uneven for any equal cut."""
    out = []
    for a, b in zip(WIDTHS, WIDTHS[1:]):
        out.append(sw.Layer(nn.Sequential, nn.Linear(a, b), nn.GELU()))
    return out + [sw.Layer(nn.Linear, WIDTHS[-1], 10)]


def mlp_data(batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, WIDTHS[0], generator=g), torch.randint(0, 10, (batch,), generator=g)


MODELS: dict[str, Any] = {
    "gpt": (gpt_layers, gpt_loss, gpt_data, 32, 2),  # layers, loss, data, global batch, profiled micro-batch
    "mlp": (mlp_layers, F.cross_entropy, mlp_data, 256, 8),
}


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


def alone_profile(layers: list[sw.Layer], sample: Any, rank: int) -> LayerProfile:
    """Rank 0 profiles while the others wait (a core to itself: the planner's ``cores`` models the sharing), in
    :data:`PROFILE_ROUNDS` rounds, each layer from its fastest (``sw.profile(rounds=...)``: three profiles of the
    MLP in one 4-rank run, one after another, gave its per-sample forward 37 / 50 / 53 us)."""
    text: list[Any] = [None]
    if rank == 0:
        model = sw.build_model(layers, seed=0)  # the layers as a pipeline builds them, each one timed on its own
        text = [sw.profile(model, sample, repeats=7, warmup=2, rounds=PROFILE_ROUNDS).to_json()]
    dist.broadcast_object_list(text, 0)
    return LayerProfile.from_json(text[0])  # type: ignore[arg-type]


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


def choose(plans: list[sw.Plan], count: int) -> list[tuple[int, sw.Plan]]:
    """The top 3, then ``count - 3`` spread over the rest down to the worst."""
    picks = list(range(min(3, len(plans))))
    rest = list(range(3, len(plans)))
    if rest and count > 3:
        step = max(1, len(rest) // (count - 3))
        picks += rest[::step][: count - 4] + [rest[-1]]
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
    """Median step time of each plan without the activation meter (its hooks cost time), then one metered step each.

    The plans take turns: ``steps`` timed steps per plan in :data:`ROUNDS` rounds, every plan once per round, so a
    load that comes and goes on this shared machine weighs on every plan alike rather than on whichever ran then.
    Each turn starts with an untimed step (two in the first round): a run of one plan times warm steps, and the
    first step after another plan's runs cold. A step's time is the slowest rank's, from a barrier; ``cpu_total``
    is every rank's CPU time in it, summed (all threads of each process). ``speed()`` is read before each round
    and after the last (returned with the rows).
    """
    make, loss_fn, data, batch, _ = MODELS[model]
    meshes = mesh_per_layout(plans)
    pipes = [
        sw.Pipeline.from_plan(plan, make(), loss_fn=loss_fn, seed=0, timeout=120, parallel=meshes[plan.layout])
        for plan in plans
    ]
    times: list[list[float]] = [[] for _ in plans]
    rounds: list[list[float]] = [[] for _ in plans]  # each round's median step time
    cpus: list[list[float]] = [[] for _ in plans]  # the busiest rank's CPU seconds in the step (its process)
    sums: list[list[float]] = [[] for _ in plans]  # every rank's CPU seconds in the step, summed
    per_round = -(-steps // ROUNDS)
    speeds = []
    for round_ in range(ROUNDS):
        speeds.append(speed())
        for k, pipe in enumerate(pipes):
            warm = 2 if round_ == 0 else 1  # each turn starts warm, as a run of one plan does
            start = len(times[k])
            for step in range(warm + per_round):
                wall, busiest, total = _timed_step(pipe, *data(batch, step))
                if step >= warm:
                    times[k].append(wall)
                    cpus[k].append(busiest)
                    sums[k].append(total)
            rounds[k].append(statistics.median(times[k][start:]))
    speeds.append(speed())
    out = []
    for plan, ts, cs, total, medians in zip(plans, times, cpus, sums, rounds):
        out.append(
            {
                "measured": statistics.median(ts),
                "runs": len(ts),
                "round_medians": medians,
                "measured_activations": _metered_peak(plan, model, meshes[plan.layout]),
                "cpu_busiest": statistics.median(cs),
                "cpu_total": statistics.median(total),
            }
        )
    return out, speeds


def _timed_step(pipe: sw.Pipeline, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float, float]:
    """One train step from a barrier: (the slowest rank's seconds, the busiest rank's CPU seconds, all ranks' CPU
    seconds summed)."""
    inputs = pipe.local_batch(x, y)
    dist.barrier()
    t, c = time.perf_counter(), time.process_time()
    pipe.train_step(*inputs)
    elapsed = torch.tensor([time.perf_counter() - t, time.process_time() - c])
    total = elapsed.clone()
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return float(elapsed[0]), float(elapsed[1]), float(total[1])


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


def _chosen(found: Any, count: int, earlier: dict | None, model: str) -> list[tuple[int, sw.Plan]]:
    """The plans to time, with their place in this run's ranking: :func:`choose`'s, or an earlier run's."""
    if earlier is None:
        return choose(list(found.plans), count)
    where = {p.describe(): (k, p) for k, p in enumerate(found.plans)}  # the plans an earlier run timed, ranked anew
    wanted = [r["plan"] for r in earlier["models"][model]["rows"]]
    missing = [name for name in wanted if name not in where]
    if missing:
        raise SystemExit(f"--same-plans: {model} plans {missing} are not among this run's {len(where)}")
    return [where[name] for name in wanted]


def _row(k: int, first: sw.Plan, plan: sw.Plan, timed: dict[str, Any], before: dict, bare: dict) -> dict[str, Any]:
    """One timed plan: its predictions (now, at the calibration, round 5's, bare) and what was measured."""
    row: dict[str, Any] = {"rank": k + 1, "plan": plan.describe(), "predicted": plan.step_time}
    row["predicted_at_calibration"] = first.step_time
    row["predicted_before"] = before[plan.describe()].step_time if plan.describe() in before else None
    row["bare"] = bare[plan.describe()].step_time if plan.describe() in bare else None
    row["cpu_bound"] = max(plan.breakdown["cpu_bound"], plan.breakdown["shared_cores"]) > plan.breakdown["simulated"]
    row["predicted_activations"] = max(m.activations for m in plan.memory)
    row["compute_busiest"] = plan.breakdown["compute"]
    row.update(timed)
    return row


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
    # with --same-plans every plan is ranked: an earlier run's may lie beyond this run's top 400
    top = 400 if earlier is None else 100_000
    found = search(linear, world, calibration=cal, compute_scale=scale, top=top, **common)
    bare = {p.describe(): p for p in search(linear, world, intra=cal.intra, top=100_000, **common).plans}
    chosen = _chosen(found, args.plans, earlier, model)
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
        profiles[model] = affine(alone_profile(make(), x[:b0], env.rank), alone_profile(make(), x, env.rank))
    cal = sw.calibrate(timeout=120)
    report: dict[str, Any] = {"world": env.world_size, "cores": cal.cores, "calibration": cal.to_dict(), "models": {}}
    for model, profile in profiles.items():
        report["models"][model] = measure_model(model, profile, cal, args, same)
    if env.rank == 0:
        args.out.write_text(json.dumps(report, indent=1))
    dist.barrier()


if __name__ == "__main__":
    main()
