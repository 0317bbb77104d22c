"""The simulator: times a schedule under a cost model, and tracks activation memory.

Each rank runs its actions in order; a compute action starts when its rank is
free and its input has arrived. A value made on another rank arrives one
transfer time (``latency + bytes / bandwidth``) after it leaves: transfers
overlap compute; a rank's messages to another machine leave its link one after
another, each holding it for its bytes' time (``CostModel.boundary_wires``),
and their latencies overlap. SYNC and STEP cost ``sync_time`` /
``step_time`` on their own rank and wait for nobody else; SEND/RECV take no
rank time. The same rules apply to compute-only and complete schedules, so a
schedule can be timed before lowering.

Because every rank keeps its order and starts each action as early as it can,
the makespan is the longest path through the schedule's dependency graph. That
is what the closed forms in the tests check: with uniform costs and free
transfers, GPipe and 1F1B take (m + p - 1)(F + B); a transfer time c adds
2(p - 1)c to GPipe but 2c[(p - 1) + floor((m - 1)(p - 1) / p)] to 1F1B, whose
steady state waits for every round trip.

Times: F costs ``forward``, I ``backward_input``, W ``backward_weight`` and B
its own ``backward_full`` (I + W when the cost model leaves it out).

Memory: F allocates its stage's ``activation_bytes`` when it starts; B frees
them when it ends; I, when it ends, leaves ``weight_activation_bytes`` in their
place (W's stash, which can be larger), and W frees that.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from .._util import gc_paused
from ..ir import COMM, SEND_F, SYNC, Action, B, Columns, Event, F, I, Kind, Schedule, Timeline, W, columns, in_range
from .costs import CostModel
from .earliest import earliest_starts

_F, _B, _I, _W, _SYNC, _STEP = Kind.F, Kind.B, Kind.I, Kind.W, Kind.SYNC, Kind.STEP


@dataclass(eq=False)
class SimResult:
    """What :func:`simulate` found.

    ``peak_activations[r]`` counts, in micro-batches, the most activations
    rank r held at once (a stage-activation of one micro-batch counts 1/v, so
    the figure compares across virtual-stage counts; an activation counts
    until its I or B ends). ``peak_activation_bytes[r]`` is the same peak in
    bytes, where what W needs (``weight_activation_bytes``) stays alive
    from I until W ends. ``memory[r]`` is rank r's activation bytes as a step
    function ``[(time, bytes), ...]``: the value holds from that time on.

    ``timeline`` and ``memory`` are built on first use, so a planner that only
    reads the makespan does not pay for one :class:`~stagewise.ir.timeline.Event`
    per action.
    """

    name: str
    num_ranks: int
    makespan: float
    bubble_ratio: float
    peak_activations: list[float]
    peak_activation_bytes: list[float]
    costs: CostModel = field(repr=False)
    meta: dict[str, object] = field(default_factory=dict, repr=False)
    _schedule: Schedule | None = field(default=None, repr=False)
    #: every action that took rank time, rank after rank: start and end times; rank r holds base[r]..base[r+1]-1
    _start: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False)
    _end: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False)
    _base: list[int] = field(default_factory=list, repr=False)

    @cached_property
    def starts(self) -> list[list[float]]:
        """Per rank, the start time of each of :attr:`actions`."""
        return self._split(self._start)

    @cached_property
    def ends(self) -> list[list[float]]:
        """Per rank, the end time of each of :attr:`actions`."""
        return self._split(self._end)

    def _split(self, times: np.ndarray) -> list[list[float]]:
        flat = times.tolist()
        return [flat[a:b] for a, b in zip(self._base[:-1], self._base[1:], strict=True)]

    @cached_property
    def actions(self) -> list[list[Action]]:
        """Per rank, the actions that took rank time (all but SEND/RECV), in order; built on first use."""
        if self._schedule is None:
            return [[] for _ in range(self.num_ranks)]
        return [[a for a in acts if a[1] not in COMM] for acts in self._schedule.ranks]

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
                    total -= act[s] - keep[s]
                elif kind is _W:
                    total -= keep[s]
                else:
                    continue
                curve.append((end, total))
            curves.append(curve)
        return curves


def simulate(schedule: Schedule, costs: CostModel | None = None) -> SimResult:
    """Time ``schedule`` under ``costs`` (uniform F = I = W = 1, free transfers by default).

    Raises ``ValueError`` when the cost model has the wrong number of stages,
    when an action is not a (stage, kind, micro-batch) in range, or when the
    schedule cannot finish (a rank waits for a value nobody makes first);
    :func:`~stagewise.validate.schedules.validate_schedule` explains the latter.
    """
    n = schedule.num_stages
    if costs is None:
        costs = CostModel.uniform(n)
    if costs.num_stages != n:
        raise ValueError(f"cost model describes {costs.num_stages} stages, schedule {schedule.name!r} has {n}")
    with gc_paused():
        cols = columns(schedule)  # the validator's, when it just passed this schedule
        if cols is None or (
            schedule.__dict__.get("_validated_as") is None and not in_range(cols, n, schedule.num_microbatches)
        ):
            raise ValueError(_first_unreadable(schedule))
        return _simulate(schedule, cols, costs)


def _first_unreadable(schedule: Schedule) -> str:
    """The error for the first action that is not a (stage, kind, micro-batch) in range (a slow scan: errors only)."""
    n, m = schedule.num_stages, schedule.num_microbatches
    for rank, acts in enumerate(schedule.ranks):
        for a in acts:
            s, kind, mb = a
            per_stage = kind is Kind.SYNC or kind is Kind.STEP
            if not (any(kind is k for k in Kind) and isinstance(s, int) and (per_stage or isinstance(mb, int))):
                return (
                    f"schedule {schedule.name!r}: rank {rank} runs {tuple(a)!r}, which is not an action "
                    "(stage, Kind, micro-batch)"
                )
            if not (0 <= s < n and (mb is None if per_stage else 0 <= mb < m)):  # type: ignore[operator]
                return (
                    f"schedule {schedule.name!r}: rank {rank} runs {a}, outside stages 0..{n - 1} "
                    f"and micro-batches 0..{m - 1}"
                )
    raise AssertionError("columns() refused a schedule whose every action reads")  # pragma: no cover


def _simulate(schedule: Schedule, cols: Columns, costs: CostModel) -> SimResult:
    """Every per-action fact as arrays, then the one sequential walk (:func:`.earliest.earliest_starts`)."""
    n, m, p = schedule.num_stages, schedule.num_microbatches, schedule.num_ranks
    x = _TimedFacts(schedule, cols, costs)
    base_l = x.base.tolist()
    start_l, reached = earliest_starts(
        x.need.tolist(), x.make.tolist(), x.took.tolist(), x.delay.tolist(), base_l, 2 * n * m, x.wires()
    )
    stuck = [r for r in range(p) if reached[r] < base_l[r + 1]]
    if stuck:
        r = stuck[0]
        waits = schedule.ranks[r][int(np.nonzero(x.timed)[0][reached[r]] - cols.base[r])]
        raise ValueError(
            f"schedule {schedule.name!r} cannot finish: rank {r} waits at {waits} "
            f"for a value no rank produces first (run validate_schedule for details)"
        )
    start = np.fromiter(start_l, np.float64, len(start_l))
    end = start + x.took  # the walk's own sums: t += took
    peak_count, peak_bytes, busy = _per_rank_sums(x, costs, start, end, base_l)
    present = x.lens > 0
    makespan = float(end[x.base[1:][present] - 1].max() - start[x.base[:-1][present]].min()) if present.any() else 0.0
    bubble = 1.0 - sum(busy) / (p * makespan) if makespan > 0 else 0.0
    inv_v = 1.0 / schedule.virtual_stages
    return SimResult(
        name=schedule.name,
        num_ranks=p,
        makespan=makespan,
        bubble_ratio=bubble,
        peak_activations=[c * inv_v for c in peak_count],
        peak_activation_bytes=peak_bytes,
        costs=costs,
        meta={
            "num_stages": n,
            "num_microbatches": m,
            "virtual_stages": schedule.virtual_stages,
            "placement": list(schedule.placement),
        },
        _schedule=schedule,
        _start=start,
        _end=end,
        _base=base_l,
    )


class _TimedFacts:
    """Per action that takes rank time (all but SEND/RECV), rank after rank: what the walk needs, as arrays.

    ``need`` / ``make``: the message it waits for / makes, or -1 (a message is a flat int: (stage, micro-batch)
    -> ``2 * (stage * m + mb)``, +1 for gradients); ``took``: its duration; ``delay``: its message's transfer
    time, ``wire`` how long it holds the rank's link between machines; ``base``: rank r holds ``base[r]`` to
    ``base[r + 1] - 1``.
    """

    def __init__(self, schedule: Schedule, cols: Columns, costs: CostModel) -> None:
        n, m, p = schedule.num_stages, schedule.num_microbatches, schedule.num_ranks
        self.timed = (cols.kind < SEND_F) | (
            cols.kind >= SYNC
        )  # SEND/RECV take no rank time: transfers are in arrivals
        kind, stage, mb = cols.kind[self.timed], cols.stage[self.timed], cols.microbatch[self.timed]
        self.kind, self.stage = kind, stage
        self.lens = np.bincount(cols.rank[self.timed], minlength=p)
        self.base = np.zeros(p + 1, np.int64)
        np.cumsum(self.lens, out=self.base[1:])
        fwd, b_in, b_wt, b_full = (
            np.asarray(v, np.float64)
            for v in (costs.forward, costs.backward_input, costs.backward_weight, costs.backward_times())
        )
        # arrival delay of stage s's output at stage s+1, and of stage s's input gradient at stage s-1
        # (0 where s and s+1 share a rank; the local link where they share a node)
        delay_f = np.asarray(costs.boundary_transfers(schedule.placement, p), np.float64)
        delay_b = np.zeros(n)
        delay_b[1:] = delay_f[:-1]
        self.is_f, self.is_b, self.is_i, self.is_w = kind == F, kind == B, kind == I, kind == W
        is_f, is_bi = self.is_f, self.is_b | self.is_i
        key = stage * m + mb
        self.need = np.where(
            is_f & (stage > 0), 2 * (key - m), np.where(is_bi & (stage < n - 1), 2 * (key + m) + 1, -1)
        )
        self.make = np.where(is_f & (stage < n - 1), 2 * key, np.where(is_bi & (stage > 0), 2 * key + 1, -1))
        self.took = np.select(
            [is_f, self.is_b, self.is_i, self.is_w, kind == SYNC],
            [fwd[stage], b_full[stage], b_in[stage], b_wt[stage], np.asarray(costs.sync_time)[stage]],
            np.asarray(costs.step_time, np.float64)[stage],
        )
        self.delay = np.where(is_f, delay_f[stage], delay_b[stage])
        # how long its message holds its rank's link between machines (0 inside one: CostModel.boundary_wires)
        wire_f = np.asarray(costs.boundary_wires(schedule.placement, p), np.float64)
        wire_b = np.zeros(n)
        wire_b[1:] = wire_f[:-1]
        self.wire = np.where(is_f, wire_f[stage], wire_b[stage])

    def wires(self) -> list[float] | None:
        """How long each action's message holds its rank's link between machines; None where none does."""
        return self.wire.tolist() if self.wire.any() else None


def _per_rank_sums(
    x: _TimedFacts, costs: CostModel, start: np.ndarray, end: np.ndarray, base: list[int]
) -> tuple[list[float], list[float], list[float]]:
    """Per rank: its peak activations in micro-batches and in bytes, and its busy time.

    Activations in each rank's order (F adds at its start, a backward frees at its end, I leaving W's stash in
    their place; the running sums are order-dependent only, so cumulative sums per rank).
    """
    act = np.asarray(costs.activation_bytes, np.float64)
    keep = np.asarray(costs.weight_activation_bytes, np.float64)
    is_f, is_b, is_i, is_w, stage = x.is_f, x.is_b, x.is_i, x.is_w, x.stage
    d_count = np.where(is_f, 1.0, np.where(is_b | is_i, -1.0, 0.0))
    d_bytes = np.select([is_f, is_b, is_i, is_w], [act[stage], -act[stage], -(act - keep)[stage], -keep[stage]], 0.0)
    spent = np.where(x.kind < SEND_F, end - start, 0.0)
    peak_count, peak_bytes, busy = [], [], []
    for a, b in zip(base[:-1], base[1:], strict=True):
        peak_count.append(max(0.0, float(np.cumsum(d_count[a:b]).max())) if b > a else 0.0)
        peak_bytes.append(max(0.0, float(np.cumsum(d_bytes[a:b]).max())) if b > a else 0.0)
        busy.append(float(np.cumsum(spent[a:b])[-1]) if b > a else 0.0)
    return peak_count, peak_bytes, busy
