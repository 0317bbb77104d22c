"""The simulator: times a schedule under a cost model, and tracks activation memory.

Each rank runs its actions in order; a compute action starts when its rank is
free and its input has arrived. A value made on another rank arrives one
transfer time (``latency + bytes / bandwidth``) after it was made: transfers
overlap compute and links never congest. SYNC and STEP cost ``sync_time`` /
``step_time`` on their own rank and wait for nobody else; SEND/RECV take no
rank time. The same rules apply to compute-only and complete schedules, so a
schedule can be timed before lowering.

Because every rank keeps its order and starts each action as early as it can,
the makespan is the longest path through the schedule's dependency graph. That
is what the closed forms in the tests check: with uniform costs and free
transfers, GPipe and 1F1B take (m + p - 1)(F + B); a transfer time c adds
2(p - 1)c to GPipe but 2c[(p - 1) + floor((m - 1)(p - 1) / p)] to 1F1B, whose
steady state waits for every round trip.

Memory: F allocates its stage's ``activation_bytes`` when it starts; B frees
them when it ends; I frees all but ``weight_activation_bytes``, which W frees.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from functools import cached_property

from ._gc import gc_paused
from .actions import COMM, Action, Kind
from .costs import CostModel
from .schedule import Schedule
from .timeline import Event, Timeline

_F, _B, _I, _W, _SYNC, _STEP = Kind.F, Kind.B, Kind.I, Kind.W, Kind.SYNC, Kind.STEP


@dataclass(eq=False)
class SimResult:
    """What :func:`simulate` found.

    ``peak_activations[r]`` counts, in micro-batches, the most activations
    rank r held at once (a stage-activation of one micro-batch counts 1/v, so
    the figure compares across virtual-stage counts; an activation counts
    until its I or B ends). ``peak_activation_bytes[r]`` is the same peak in
    bytes, where the part W needs (``weight_activation_bytes``) stays alive
    from I until W ends. ``memory[r]`` is rank r's activation bytes as a step
    function ``[(time, bytes), ...]``: the value holds from that time on.

    ``timeline`` and ``memory`` are built on first use, so a planner that only
    reads the makespan does not pay for one :class:`~stagewise.timeline.Event`
    per action.
    """

    name: str
    num_ranks: int
    makespan: float
    bubble_ratio: float
    peak_activations: list[float]
    peak_activation_bytes: list[float]
    costs: CostModel = field(repr=False)
    #: per rank: the actions that took rank time (no SEND/RECV), in order, and their start and end times
    actions: list[list[Action]] = field(repr=False)
    starts: list[list[float]] = field(repr=False)
    ends: list[list[float]] = field(repr=False)
    meta: dict[str, object] = field(default_factory=dict, repr=False)

    @cached_property
    def timeline(self) -> Timeline:
        with gc_paused():
            events = [
                Event(rank, a, start, end)
                for rank, (acts, starts, ends) in enumerate(zip(self.actions, self.starts, self.ends))
                for a, start, end in zip(acts, starts, ends)
            ]
        return Timeline(
            name=self.name,
            num_ranks=self.num_ranks,
            events=events,
            source="simulated",
            unit="cost",
            meta=dict(self.meta),
        )

    @cached_property
    def memory(self) -> list[list[tuple[float, float]]]:
        act, keep = self.costs.activation_bytes, self.costs.weight_activation_bytes
        curves = []
        for acts, starts, ends in zip(self.actions, self.starts, self.ends):
            total = 0.0
            curve = [(0.0, 0.0)]
            for a, start, end in zip(acts, starts, ends):
                kind, s = a.kind, a.stage
                if kind is _F:
                    total += act[s]
                    curve.append((start, total))
                    continue
                if kind is _B:
                    total -= act[s]
                elif kind is _I:
                    total -= act[s] - min(keep[s], act[s])
                elif kind is _W:
                    total -= min(keep[s], act[s])
                else:
                    continue
                curve.append((end, total))
            curves.append(curve)
        return curves


def simulate(schedule: Schedule, costs: CostModel | None = None) -> SimResult:
    """Time ``schedule`` under ``costs`` (uniform F = I = W = 1, free transfers by default).

    Raises ``ValueError`` when the cost model has the wrong number of stages,
    or when the schedule cannot finish (a rank waits for a value nobody makes
    first); :func:`~stagewise.validate.validate_schedule` explains the latter.
    """
    n = schedule.num_stages
    if costs is None:
        costs = CostModel.uniform(n)
    if costs.num_stages != n:
        raise ValueError(f"cost model describes {costs.num_stages} stages, schedule {schedule.name!r} has {n}")
    m = schedule.num_microbatches
    # SEND/RECV take no rank time: the transfers are in the arrival times
    ranks = [[a for a in acts if a[1] not in COMM] for acts in schedule.ranks]
    # a schedule the validator passed has every stage and micro-batch in range (placement check)
    proved = schedule.__dict__.get("_validated_as") is not None
    for rank, acts in enumerate([] if proved else ranks):
        bad = [a for a in acts if not (0 <= a[0] < n and (a[2] is None or 0 <= a[2] < m))]
        if bad:
            raise ValueError(
                f"schedule {schedule.name!r}: rank {rank} runs {bad[0]}, outside stages 0..{n - 1} "
                f"and micro-batches 0..{m - 1}"
            )
    return _simulate(schedule, ranks, costs)


def _simulate(schedule: Schedule, ranks: list[list[Action]], costs: CostModel) -> SimResult:
    n, m, p = schedule.num_stages, schedule.num_microbatches, schedule.num_ranks
    placement = schedule.placement
    fwd, b_in, b_wt = costs.forward, costs.backward_input, costs.backward_weight
    b_full = tuple(x + y for x, y in zip(b_in, b_wt))
    sync, step = costs.sync_time, costs.step_time
    act = costs.activation_bytes
    keep = tuple(min(k, a) for k, a in zip(costs.weight_activation_bytes, act))
    # Arrival delay of stage s's output at stage s+1, and of stage s's input gradient at stage s-1.
    delay_f = [costs.transfer_time(s) if s + 1 < n and placement[s + 1] != placement[s] else 0.0 for s in range(n)]
    delay_b = [costs.transfer_time(s - 1) if s > 0 and placement[s - 1] != placement[s] else 0.0 for s in range(n)]
    inv_v = 1.0 / schedule.virtual_stages
    last = n - 1

    # A message is a flat int: (stage, micro-batch) -> 2 * (stage * m + mb) (+1 for gradients).
    arrival: list[float | None] = [None] * (2 * n * m)
    waiting: dict[int, int] = {}  # message -> the rank blocked on it
    starts: list[list[float]] = [[] for _ in range(p)]
    ends: list[list[float]] = [[] for _ in range(p)]
    clock = [0.0] * p
    pos = [0] * p
    busy = [0.0] * p
    count = [0.0] * p
    mem = [0.0] * p
    peak_count = [0.0] * p
    peak_mem = [0.0] * p
    queue = deque(range(p))
    while queue:
        rank = queue.popleft()
        acts = ranks[rank]
        began, ended = starts[rank].append, ends[rank].append
        t, idx, end_idx = clock[rank], pos[rank], len(acts)
        cnt, byt, pk_c, pk_b, work = count[rank], mem[rank], peak_count[rank], peak_mem[rank], busy[rank]
        mb: int  # compute actions carry a micro-batch; per-stage ones (None) never reach the index arithmetic
        while idx < end_idx:
            a = acts[idx]
            s, kind, mb = a  # type: ignore[assignment]
            if kind is _F:
                if s:
                    ready = arrival[2 * ((s - 1) * m + mb)]
                    if ready is None:
                        waiting[2 * ((s - 1) * m + mb)] = rank
                        break
                    if ready > t:
                        t = ready
                start = t
                t += fwd[s]
                cnt += 1.0
                byt += act[s]
                if cnt > pk_c:
                    pk_c = cnt
                if byt > pk_b:
                    pk_b = byt
                if s < last:
                    key = 2 * (s * m + mb)
                    arrival[key] = t + delay_f[s]
                    if key in waiting:
                        queue.append(waiting.pop(key))
            elif kind is _B or kind is _I:
                if s < last:
                    ready = arrival[2 * ((s + 1) * m + mb) + 1]
                    if ready is None:
                        waiting[2 * ((s + 1) * m + mb) + 1] = rank
                        break
                    if ready > t:
                        t = ready
                start = t
                if kind is _B:
                    t += b_full[s]
                    byt -= act[s]
                else:
                    t += b_in[s]
                    byt -= act[s] - keep[s]
                cnt -= 1.0
                if s:
                    key = 2 * (s * m + mb) + 1
                    arrival[key] = t + delay_b[s]
                    if key in waiting:
                        queue.append(waiting.pop(key))
            elif kind is _W:
                start = t
                t += b_wt[s]
                byt -= keep[s]
            else:  # SYNC or STEP: this rank's time only, not compute
                began(t)
                t += sync[s] if kind is _SYNC else step[s]
                ended(t)
                idx += 1
                continue
            work += t - start
            began(start)
            ended(t)
            idx += 1
        clock[rank], pos[rank] = t, idx
        count[rank], mem[rank], peak_count[rank], peak_mem[rank], busy[rank] = cnt, byt, pk_c, pk_b, work

    stuck = [r for r in range(p) if pos[r] < len(ranks[r])]
    if stuck:
        r = stuck[0]
        raise ValueError(
            f"schedule {schedule.name!r} cannot finish: rank {r} waits at {ranks[r][pos[r]]} "
            f"for a value no rank produces first (run validate_schedule for details)"
        )
    firsts = [times[0] for times in starts if times]
    makespan = max(times[-1] for times in ends if times) - min(firsts) if firsts else 0.0
    bubble = 1.0 - sum(busy) / (p * makespan) if makespan > 0 else 0.0
    return SimResult(
        name=schedule.name,
        num_ranks=p,
        makespan=makespan,
        bubble_ratio=bubble,
        peak_activations=[c * inv_v for c in peak_count],
        peak_activation_bytes=peak_mem,
        costs=costs,
        actions=ranks,
        starts=starts,
        ends=ends,
        meta={
            "num_stages": n,
            "num_microbatches": m,
            "virtual_stages": schedule.virtual_stages,
            "placement": list(placement),
        },
    )
