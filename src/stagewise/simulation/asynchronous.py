"""What the simulator adds for asynchronous schedules: weight-version memory, the steady state, labelled pictures.

A post-pass over :func:`stagewise.simulation.arrays.simulate`'s result, so the
simulator's loop stays as it is. Weight versions (:mod:`stagewise.asynchronous.versions`)
cost ``parameter_bytes[s]`` each; rank r's weight memory while it runs an
action is that times the versions alive then (the current weights included).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..asynchronous import VersionTable, live_version_counts, live_versions, without_comm
from ..ir import COMM, Kind, Schedule, Timeline, columns
from ..validate import async_table
from .arrays import SimResult


@dataclass(frozen=True)
class AsyncReport:
    """Per rank: peak weight versions and their bytes, peak activations plus weights; the steady state.

    ``period``: time between two consecutive STEPs of rank 0 from its first
    to its last (one mini-batch per period in the steady state; m(F + B) with
    uniform costs). ``throughput``: mini-batches per unit time over the whole
    window (N / makespan), which tends to 1 / period as N grows.
    """

    peak_versions: list[int]
    peak_weight_bytes: list[float]
    peak_total_bytes: list[float]
    weight_memory: list[list[tuple[float, float]]]
    period: float
    throughput: float
    bubble_ratio: float


def _table(schedule: Schedule) -> VersionTable:
    table = async_table(schedule)
    if table is None:
        raise ValueError(f"schedule {schedule.name!r} has no version table: it is not an asynchronous schedule")
    return table


def async_report(schedule: Schedule, result: SimResult) -> AsyncReport:
    """Weight-version memory and steady state of ``schedule``, timed as ``result`` (``simulate(schedule, costs)``)."""
    table = _table(schedule)
    counts = _counts(schedule, table)
    param = result.costs.parameter_bytes
    curves, peaks, peak_bytes, totals = [], [], [], []
    act_curves = result.memory
    for rank, row in enumerate(counts):
        s = schedule.stages_of(rank)[0]
        starts = result.starts[rank]
        curve = [(starts[j], row[j] * param[s]) for j in range(len(row))]
        curves.append(curve)
        peaks.append(max(row, default=0))
        peak_bytes.append(max(row, default=0) * param[s])
        totals.append(_peak_sum(act_curves[rank], curve))
    step_ends = [e for a, e in zip(result.actions[0], result.ends[0]) if a.kind is Kind.STEP]
    period = (step_ends[-1] - step_ends[0]) / (len(step_ends) - 1) if len(step_ends) > 1 else result.makespan
    throughput = table.minibatches / result.makespan if result.makespan > 0 else 0.0
    return AsyncReport(peaks, peak_bytes, totals, curves, period, throughput, result.bubble_ratio)


def peak_versions(schedule: Schedule) -> list[int]:
    """Per rank, the most weight versions alive at once: ``async_report(...).peak_versions`` without the timing."""
    return [max(row, default=0) for row in _counts(schedule, _table(schedule))]


def _counts(schedule: Schedule, table: VersionTable) -> list[list[int]]:
    """Versions alive at each action of each rank, SEND/RECV left out: on the columns when they read (no action
    objects made), else by the list sweep."""
    cols = columns(schedule)
    counts = None if cols is None else live_version_counts(without_comm(cols), table)
    if counts is not None:
        return [row.tolist() for row in counts]
    return live_versions([[a for a in acts if a[1] not in COMM] for acts in schedule.ranks], table)


def _peak_sum(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """The peak of the sum of two step functions [(time, value from then on), ...]."""
    events = sorted([(t, 0, v) for t, v in a] + [(t, 1, v) for t, v in b])
    cur = [0.0, 0.0]
    peak = 0.0
    k = 0
    while k < len(events):
        t = events[k][0]
        while k < len(events) and events[k][0] == t:
            cur[events[k][1]] = events[k][2]
            k += 1
        peak = max(peak, cur[0] + cur[1])
    return peak


def labelled_timeline(schedule: Schedule, result: SimResult) -> Timeline:
    """``result.timeline`` with each F and B labelled by its micro-batch and version (``3v1``) for the PNG."""
    timeline = result.timeline
    timeline.meta["labels"] = _table(schedule).labels()
    return timeline
