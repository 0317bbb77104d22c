"""The simulator: times a schedule under a cost model, and tracks activation memory.

Each rank runs its actions in order; a compute action starts when its rank is
free and its input has arrived. A value made on another rank arrives one
transfer time after it was made (transfers overlap compute). SYNC and STEP cost
``sync_time`` / ``step_time``; SEND/RECV take no rank time. The same rules
apply to compute-only and complete schedules, so one can be timed before
lowering.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .actions import Kind
from .costs import CostModel
from .dataflow import Message, consumes, produces
from .schedule import Schedule
from .timeline import Event, Timeline


@dataclass
class SimResult:
    """What :func:`simulate` found.

    ``peak_activations[r]`` counts, in micro-batches, the most activations
    rank r held at once (a stage-activation of one micro-batch counts 1/v, so
    the figure compares across virtual-stage counts); ``memory[r]`` is the
    rank's activation bytes as a step function [(time, bytes), ...].
    """

    timeline: Timeline
    makespan: float
    bubble_ratio: float
    peak_activations: list[float]
    peak_activation_bytes: list[float]
    memory: list[list[tuple[float, float]]]


def simulate(schedule: Schedule, costs: CostModel | None = None) -> SimResult:
    """Time ``schedule`` under ``costs`` (uniform F = I = W = 1, free transfers by default)."""
    n = schedule.num_stages
    if costs is None:
        costs = CostModel.uniform(n)
    if costs.num_stages != n:
        raise ValueError(f"cost model describes {costs.num_stages} stages, schedule {schedule.name!r} has {n}")
    ranks = schedule.ranks
    placement = schedule.placement
    clock = [0.0] * len(ranks)
    pos = [0] * len(ranks)
    ready: dict[Message, float] = {}  # message -> arrival time at its consumer
    waiting: dict[Message, int] = {}
    events: list[Event] = []
    queue = deque(range(len(ranks)))
    while queue:
        rank = queue.popleft()
        acts = ranks[rank]
        t = clock[rank]
        while pos[rank] < len(acts):
            a = acts[pos[rank]]
            kind = a.kind
            if kind.is_comm:
                pos[rank] += 1
                continue
            start = t
            if kind.is_compute:
                need = consumes(a, n)
                if need is not None:
                    arrival = ready.get(need)
                    if arrival is None:
                        waiting[need] = rank
                        break
                    start = max(t, arrival)
                s = a.stage
                if kind is Kind.F:
                    duration = costs.forward[s]
                elif kind is Kind.B:
                    duration = costs.backward_input[s] + costs.backward_weight[s]
                elif kind is Kind.I:
                    duration = costs.backward_input[s]
                else:
                    duration = costs.backward_weight[s]
            elif kind is Kind.SYNC:
                duration = costs.sync_time[a.stage]
            else:
                duration = costs.step_time[a.stage]
            t = start + duration
            events.append(Event(rank, a, start, t))
            if kind.is_compute:
                made = produces(a, n)
                if made is not None:
                    dst = a.stage + 1 if made.direction == "F" else a.stage - 1
                    if placement[dst] == rank:
                        ready[made] = t
                    else:
                        size_stage = a.stage if made.direction == "F" else a.stage - 1
                        ready[made] = t + costs.transfer_time(size_stage)
                    waiter = waiting.pop(made, None)
                    if waiter is not None:
                        queue.append(waiter)
            pos[rank] += 1
        clock[rank] = t
    stuck = [r for r in range(len(ranks)) if pos[r] < len(ranks[r])]
    if stuck:
        r = stuck[0]
        raise ValueError(
            f"schedule {schedule.name!r} cannot finish: rank {r} waits at {ranks[r][pos[r]]} "
            f"for a value no rank produces first (run validate_schedule for details)"
        )
    timeline = Timeline(
        name=schedule.name,
        num_ranks=schedule.num_ranks,
        events=events,
        source="simulated",
        unit="cost",
        meta={"num_stages": n, "num_microbatches": schedule.num_microbatches},
    )
    peaks, peak_bytes, memory = _activation_memory(schedule, events, costs)
    return SimResult(
        timeline=timeline,
        makespan=timeline.makespan,
        bubble_ratio=timeline.bubble_ratio,
        peak_activations=peaks,
        peak_activation_bytes=peak_bytes,
        memory=memory,
    )


def _activation_memory(
    schedule: Schedule, events: list[Event], costs: CostModel
) -> tuple[list[float], list[float], list[list[tuple[float, float]]]]:
    """Activation count and bytes per rank over time.

    F allocates its stage's activation when it starts; B frees it all when it
    ends; I frees all but the part W still needs, which W frees.
    """
    v = schedule.virtual_stages
    deltas: list[list[tuple[float, int, float, float]]] = [[] for _ in range(schedule.num_ranks)]
    for e in events:
        s, kind = e.action.stage, e.action.kind
        full, keep = costs.activation_bytes[s], costs.weight_activation_bytes[s]
        if kind is Kind.F:
            deltas[e.rank].append((e.start, 1, 1.0, full))
        elif kind is Kind.B:
            deltas[e.rank].append((e.end, 0, -1.0, -full))
        elif kind is Kind.I:
            deltas[e.rank].append((e.end, 0, -1.0, -(full - min(keep, full))))
        elif kind is Kind.W:
            deltas[e.rank].append((e.end, 0, 0.0, -min(keep, full)))
    peaks, peak_bytes, memory = [], [], []
    for rank_deltas in deltas:
        rank_deltas.sort(key=lambda d: (d[0], d[1]))  # frees before allocations at the same instant
        count = total = 0.0
        best_count = best_bytes = 0.0
        curve = [(0.0, 0.0)]
        for time, _, dc, db in rank_deltas:
            count += dc
            total += db
            best_count = max(best_count, count)
            best_bytes = max(best_bytes, total)
            curve.append((time, total))
        peaks.append(best_count / v)
        peak_bytes.append(best_bytes)
        memory.append(curve)
    return peaks, peak_bytes, memory
