"""What the calibrating run measured of each stage (issue 49 item 2): pure arithmetic, no torch.

Each compute event's seconds on a core of its own (:func:`deshared`: while ``n`` ranks compute on ``c`` cores,
each advances at ``min(1, c / n)``), their median per stage and kind (:func:`stage_medians`), how far a stage's
total moves from step to step (:func:`stage_spreads`), and how far one stage's scale misses the others'
(:func:`stage_holdout_error`): what :func:`stagewise.planning.recalibrate.calibrate_run` calibrates from.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from ..ir import Event, Kind, Timeline
from ..simulation import CostModel
from .core_share import shared_seconds
from .link_fit import COMPUTE

__all__ = ["deshared", "stage_holdout_error", "stage_medians", "stage_spreads"]


def deshared(timeline: Timeline, cores: float) -> list[tuple[Event, float]]:
    """Each compute event with its seconds on a core of its own: the integral over the event of
    ``min(1, cores / n(t))``, ``n(t)`` the compute events in progress at ``t`` (every rank one process)."""
    if not cores > 0:
        raise ValueError(f"deshared: cores must be > 0, got {cores!r}")
    compute = [e for e in timeline.events if e.action.kind in COMPUTE and e.end > e.start]
    return list(zip(compute, shared_seconds([(e.start, e.end) for e in compute], cores)))


def stage_medians(timelines: Sequence[Timeline], cores: float) -> dict[Kind, dict[int, float]]:
    """Per kind and stage, the median of the de-shared seconds over every micro-batch of every timeline."""
    seen: dict[Kind, dict[int, list[float]]] = {}
    for timeline in timelines:
        for e, own in deshared(timeline, cores):
            seen.setdefault(e.action.kind, {}).setdefault(e.action.stage, []).append(own)
    return {k: {s: statistics.median(v) for s, v in by.items()} for k, by in seen.items()}


def stage_spreads(timelines: Sequence[Timeline], cores: float, stages: int) -> tuple[float, ...]:
    """Per stage, the sample standard deviation over the mean of its de-shared compute seconds per timeline
    (0 with fewer than 2 timelines or a stage that computed nothing)."""
    totals = [[0.0] * stages for _ in timelines]
    for k, timeline in enumerate(timelines):
        for e, own in deshared(timeline, cores):
            totals[k][e.action.stage] += own
    out = []
    for s in range(stages):
        xs = [t[s] for t in totals]
        mean = sum(xs) / len(xs) if xs else 0.0
        out.append(statistics.stdev(xs) / mean if len(xs) > 1 and mean > 0 else 0.0)
    return tuple(out)


def stage_holdout_error(measured: dict[Kind, dict[int, float]], charged: CostModel) -> float | None:
    """Leave one stage out: per kind and stage, the log of the stage's measured-over-charged ratio against the
    median ratio of the other stages of that kind (what the stage would have been predicted at from them); the
    root mean square over every kind and stage, or ``None`` with fewer than two stages of any kind measured.
    ``charged``: the prior's costs cut as the calibrating plan cut them."""
    columns = {Kind.F: charged.forward, Kind.B: charged.backward_times(), Kind.I: charged.backward_input,
               Kind.W: charged.backward_weight}  # fmt: skip
    errors = []
    for kind, by_stage in measured.items():
        ratios = {s: v / columns[kind][s] for s, v in by_stage.items() if columns[kind][s] > 0 and v > 0}
        for s, r in ratios.items():
            others = [x for t, x in ratios.items() if t != s]
            if others:
                errors.append(math.log(r / statistics.median(others)))
    return math.sqrt(sum(e * e for e in errors) / len(errors)) if errors else None
