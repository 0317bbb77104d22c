"""``measure_compute_scale()``: what the runtime's compute actions cost on the group, over the planner's prediction.

A layer profile times each layer alone, warm, back to back in one process. A
pipeline stage runs the same layers as one action after a wait, in one of
several processes sharing the cores: its weights and saved activations have
left the cache, the processes beside it take cache and memory bandwidth, its
backward walks the stage's graph from a received gradient, the last stage adds
the loss; a schedule that splits the backward runs two passes (I, then W) where
the profile's split sums to the fused one. Measured on this project's 2-core
machine (benchmarks/RESULTS.md, round 6): at 4 and 8 ranks the demo GPT's F, B
and I + W actions spend 0.95-1.36x, 1.07-1.55x and 1.46-2.27x the plans'
predictions for them in CPU time (I + W was then predicted at B's cost; the
profile's own I and W are charged now, so the third factor holds only what the
runtime adds beyond them).

The probe: the planner's own 1F1B plan over every rank (one stage each, no
replicas) with about two micro-batches per rank, so that most of its step has
every rank computing, as the plans worth running do; then the same with ZB-H1,
which splits the backward. A few steps of each; each rank's CPU seconds in its
F, B and I + W actions (from their input's arrival: waits excluded), summed
over ranks and over the two probes, per step; the median step over the same
sums of the plans' predicted costs. The steps are taken in ``passes`` turns,
the two probes alternating: on this project's 2-core VM with 8 ranks, the
median of 10 steps of one pipeline moved by up to a fifth from one second to
the next (nothing else running), so one burst of steps measures the moment as
much as the layers (eight consecutive probes of 10 steps: forward factors
1.68-2.16; five of three turns: 1.65-1.86).
``sw.plan(..., compute_scale=...)`` multiplies every stage's forward, fused
backward and split backward by the three factors. As they include what sharing
the cores costs beyond the cores themselves, plan with them on the
calibration's cores (``sw.calibrate()``'s cache-resident probe), not on cores
measured on the model's own work (``calibrate(workload=...)``), which count
that cost too.

A collective: every rank of the default group calls it with the same arguments.
"""

from __future__ import annotations

import copy
import statistics
import time
from typing import TYPE_CHECKING, Any

from ..._util import is_count
from ...ir import Kind
from ...partition import LayerProfile
from ..comm.groups import group_size, require_initialized
from ..frontends.balance import on_first_rank
from ..interrupt import uncounted
from ..measure.links import summed
from .progress import Steps

if TYPE_CHECKING:
    from ...planning import Plan
    from ..hybrid.mesh import Mesh

#: the probes' schedules: the backward fused (B), then split (I and W)
PROBES = ("1f1b", "zb-h1")
WARMUP = 2  # untimed steps first (the first learns shapes and builds buffers); the median is over the rest


def measure_compute_scale(
    profile: LayerProfile,
    layers: Any,
    loss_fn: Any,
    inputs: Any,
    targets: Any,
    *,
    steps: int = 10,
    passes: int = 3,
    parallel: Mesh | None = None,
    timeout: float = 60.0,
    progress: bool = True,
    **options: Any,
) -> tuple[float, float, float]:
    """``(forward, backward, split backward)``: the runtime's CPU seconds in F, in B and in I + W actions over the
    planner's prediction for them, on 1F1B and ZB-H1 pipelines of ``layers`` over every rank (see the module
    docstring): ``steps`` timed steps of each per pass, in ``passes`` passes.

    ``options`` are those of :func:`stagewise.plan` (``global_batch``, ``profile_batch``, ``overhead``,
    ``calibration``, ...), as the plans to be scaled will get them; ``inputs`` and ``targets`` one global batch.
    ``parallel``: a built mesh of the probes' layout to reuse (:func:`probe_plan` names it), else one is built.
    The probes train deep copies of ``layers``: the modules given keep their weights, buffers and gradients.
    ``progress``: rank 0 draws a bar naming the probe under way (rich, on stderr).
    """
    require_initialized()
    for name, value in (("steps", steps), ("passes", passes)):
        if not is_count(value):
            raise ValueError(f"measure_compute_scale: {name} must be an int >= 1, got {value!r}")
    if not timeout > 0:
        raise ValueError(f"measure_compute_scale: timeout must be > 0 seconds, got {timeout!r}")
    # every rank probes the same plans: each rank's own profile times the layers a little differently, and a
    # time-balanced cut of two profiles can differ (Pipeline.from_plan refuses plans that differ)
    mine = profile
    profile = on_first_rank(None, lambda: mine, "handing rank 0's profile to the probes", timeout)
    plans = [probe_plan(profile, group_size(None), schedule, **options) for schedule in PROBES]
    if parallel is None:  # both probes have the layout pp = every rank: one mesh for the two
        from ..hybrid.mesh import build_mesh

        parallel = build_mesh(plans[0].layout)
    pipes: list[Any] = []
    with Steps("measure_compute_scale", 1 + passes * len(plans), progress) as bar, uncounted():
        try:
            bar.next("building the probe pipelines")
            pipes += [_pipeline(plan, layers, loss_fn, parallel, timeout) for plan in plans]
            batches = [pipe.local_batch(inputs, targets) for pipe in pipes]
            measured = _turns(pipes, batches, steps, passes, bar)
        finally:
            for pipe in pipes:
                pipe.transport.close()
    predicted = [sum(col) for col in zip(*(_predicted(plan, pipe) for plan, pipe in zip(plans, pipes)))]
    n = len(measured)
    both = summed([x for row in measured for x in row] + predicted, time.monotonic() + timeout)
    per_step, total = [both[3 * i : 3 * i + 3] for i in range(n)], both[3 * n :]
    # the median step: a step that a burst of other work on the machine slowed does not move it
    f, b, iw = (_ratio(statistics.median_low(row[k] for row in per_step), total[k]) for k in range(3))
    return f, b, iw


def probe_plan(profile: LayerProfile, processes: int, schedule: str = "1f1b", **options: Any) -> Plan:
    """A plan :func:`measure_compute_scale` runs: ``schedule``, no recompute, one stage per process (no replicas),
    and the micro-batch count closest to twice the processes."""
    from ...planning import search

    options = {**options, "schedules": [schedule], "recompute": (None,), "top": 100_000}
    options.pop("compute_scale", None)  # the probe measures against the profile as it is
    plans = [
        p for p in search(profile, processes, **options).plans if p.layout.dp == p.layout.tp == p.layout.sharding == 1
    ]
    if not plans:
        raise ValueError(
            f"measure_compute_scale: no {schedule} pipeline without replicas fits {processes} processes "
            f"(the probe needs one plan of pp = processes, dp = tp = sharding = 1)"
        )
    want = 2 * processes
    return min(plans, key=lambda p: (abs(p.microbatches - want), p.microbatches))


def _pipeline(plan: Plan, layers: Any, loss_fn: Any, mesh: Mesh, timeout: float) -> Any:
    """A pipeline of ``plan`` training a copy of ``layers`` (modules given, or inside Layer specs, keep their
    weights and gradients)."""
    from ..pipeline import Pipeline

    return Pipeline.from_plan(plan, copy.deepcopy(layers), loss_fn=loss_fn, seed=0, timeout=timeout, parallel=mesh)


def _turns(pipes: list[Any], batches: list[Any], steps: int, passes: int, bar: Steps) -> list[list[float]]:
    """Per timed step (``steps`` per pass): the CPU seconds in F, B and I + W, summed over the probes' k-th steps;
    the probes take turns, ``passes`` times."""
    measured = [[0.0] * 3 for _ in range(steps * passes)]
    for turn in range(passes):
        for pipe, batch, name in zip(pipes, batches, PROBES):
            bar.next(f"{name}, pass {turn + 1} of {passes}")
            rows = _steps(pipe, batch, steps, WARMUP if turn == 0 else 1)
            for row, more in zip(measured[turn * steps : (turn + 1) * steps], rows):
                for k in range(3):
                    row[k] += more[k]
    return measured


def _steps(pipe: Any, batch: Any, steps: int, warm: int) -> list[list[float]]:
    """This rank's CPU seconds in F, B and I + W actions per timed step, after ``warm`` untimed ones (the first
    step learns shapes and builds buffers; a turn after the other probe's starts cold)."""
    slot = {Kind.F: 0, Kind.B: 1, Kind.I: 2, Kind.W: 2}
    rows = []
    for step in range(warm + steps):
        pipe.train_step(*batch)
        done = pipe.last_step
        if step >= warm and done is not None:
            row = [0.0, 0.0, 0.0]
            for kind, seconds in done.compute_cpu.items():
                row[slot[kind]] += seconds
            rows.append(row)
    return rows


def _predicted(plan: Plan, pipe: Any) -> list[float]:
    """The plan's prediction for this rank's F, B and I + W CPU seconds in one step."""
    costs = plan.costs
    assert costs is not None
    mine = [s for s, r in enumerate(pipe.schedule.placement) if r == pipe.rank]
    forward = plan.microbatches * sum(costs.forward[s] for s in mine)
    if pipe.schedule.uses_split_backward:  # its I and W, each as the profile measured it
        return [forward, 0.0, plan.microbatches * sum(costs.backward_input[s] + costs.backward_weight[s] for s in mine)]
    return [forward, plan.microbatches * sum(costs.backward(s) for s in mine), 0.0]  # its B, as measured


def _ratio(measured: float, predicted: float) -> float:
    """Measured over predicted; 1 where the plans predict nothing to scale (no such action)."""
    return measured / predicted if predicted > 0 and measured > 0 else 1.0
