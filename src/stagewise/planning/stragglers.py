"""A slow rank, told apart from a costly layer (issue 49 item 3): pure arithmetic on the run's timelines.

One cost model, two factors, as HetPipe's ``speeds=``: a layer costs what the calibration measured
(:class:`~stagewise.planning.recalibrate.RunCalibration`, taken while every rank ran at its usual pace), and a
rank runs at a speed, 1 when calibrated. A later step's speed of rank ``r`` is what its compute actions cost
by the calibration over what they took in that step, each on a core of its own (processor sharing undone,
:func:`~stagewise.planning.recalibrate.deshared`): a layer's cost moves every rank holding it alike, a slow
rank moves alone. A rank is named when the median of its last :data:`WINDOW` speeds, each relative to that
step's fastest rank (:class:`Detector`), falls below :data:`SLOW` (so two preempted steps name nobody, and a
rank held to half a core is named on its third slow step), and cleared when it rises above :data:`RECOVERED`.

For the speeds measured, :func:`cut_for_speeds` gives the cut the planner would choose (the min-max cut of
the calibrated layer costs, each stage's divided by its rank's speed, improved boundary by boundary by the
predicted step, :func:`~stagewise.planning.defaults.improved_counts`) and the step the model predicts for
it: what a live re-partition would apply.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace

from ..ir import Schedule, Timeline
from ..partition import LayerProfile, partition_costs
from ..simulation import CostModel
from .defaults import improved_counts
from .recalibrate import RunCalibration, deshared

#: steps whose median speed decides (5: a rank is named on the third of 5 slow steps, within the 5 steps issue
#: 49 allows, and two preempted steps of 5 are outvoted: the smoke runs on a 2-core machine at load 8 showed
#: single steps of a full-speed rank at 0.6-0.7 of its peer)
WINDOW = 5
#: a rank below this share of its calibrated speed is named (the step-to-step spread on a shared 2-core
#: machine reaches 10-15 %; a rank held to half a core runs at 0.5)
SLOW = 0.8
#: a named rank back above this share is cleared
RECOVERED = 0.9


def rank_speeds(timeline: Timeline, calibration: RunCalibration, num_ranks: int) -> list[float]:
    """Each rank's speed in one step: the calibrated seconds of its compute actions over their de-shared
    seconds in ``timeline`` (1.0 for a rank that computed nothing)."""
    expected = [0.0] * num_ranks
    took = [0.0] * num_ranks
    for e, own in deshared(timeline, calibration.cores):
        cost = calibration.measured.get(e.action.kind, {}).get(e.action.stage)
        if cost is None:
            continue
        expected[e.rank] += cost
        took[e.rank] += own
    return [x / t if t > 0 else 1.0 for x, t in zip(expected, took)]


@dataclass(frozen=True)
class Straggler:
    """A rank named slow: its speed (median of the window), and the cut for the speeds measured."""

    rank: int
    speed: float
    speeds: tuple[float, ...]
    counts: tuple[int, ...]
    now: float
    after: float

    def line(self) -> str:
        return (
            f"stagewise: rank {self.rank} is slow: it runs at {self.speed:.2f}x its calibrated speed "
            f"({1 / self.speed:.2f}x slower; speeds {[round(s, 2) for s in self.speeds]}); "
            f"the cut for these speeds is {list(self.counts)}, predicted {self.after * 1e3:.1f} ms a step against "
            f"{self.now * 1e3:.1f} ms now (stagewise.runtime.Replanner applies it live when it pays)"
        )


class Detector:
    """Feeds on each step's speeds; says who became slow (once) and who recovered.

    A step's speeds count relative to its fastest rank: a node-wide slowdown (a neighbour's job loading every
    core alike) slows every rank and names none; a straggler is slower than its peers."""

    def __init__(self, num_ranks: int) -> None:
        self.history: list[list[float]] = [[] for _ in range(num_ranks)]
        self.named: set[int] = set()

    def observe(self, speeds: Sequence[float]) -> tuple[list[int], list[int]]:
        """(ranks newly slow, ranks recovered) after this step's ``speeds``."""
        slow, back = [], []
        fastest = max(speeds) if len(speeds) and max(speeds) > 0 else 1.0
        for r, s in enumerate(s / fastest for s in speeds):
            self.history[r] = (self.history[r] + [float(s)])[-WINDOW:]
            if len(self.history[r]) < WINDOW:
                continue
            median = statistics.median(self.history[r])
            if r not in self.named and median < SLOW:
                self.named.add(r)
                slow.append(r)
            elif r in self.named and median > RECOVERED:
                self.named.discard(r)
                back.append(r)
        return slow, back

    def speeds(self) -> list[float]:
        """Each rank's current median speed (1.0 before it has a window)."""
        return [statistics.median(h) if len(h) == WINDOW else 1.0 for h in self.history]


def cut_for_speeds(
    calibrated: LayerProfile,
    schedule: Schedule,
    counts: Sequence[int],
    speeds: Sequence[float],
    calibration: RunCalibration,
) -> tuple[list[int], float, float]:
    """(the cut for rank ``speeds``, the predicted step now, the predicted step with it): ``calibrated`` is the
    calibration's layer profile, ``counts`` the cut running; each stage's cost divided by its rank's speed."""
    stage_speeds = [float(speeds[r]) for r in schedule.placement]
    start = partition_costs(calibrated.times(), schedule.num_stages, speeds=stage_speeds).counts
    best = improved_counts(start, lambda c: _predicted(calibrated, schedule, c, stage_speeds, calibration))
    now = _predicted(calibrated, schedule, counts, stage_speeds, calibration)
    after = _predicted(calibrated, schedule, best, stage_speeds, calibration)
    if after >= now:
        return list(counts), now, now
    return best, now, after


def _predicted(
    calibrated: LayerProfile,
    schedule: Schedule,
    counts: Sequence[int],
    stage_speeds: Sequence[float],
    calibration: RunCalibration,
) -> float:
    bounds = [0]
    for c in counts:
        bounds.append(bounds[-1] + int(c))
    return calibration.predict(schedule, slowed(calibrated.cost_model(bounds), stage_speeds)).step


def slowed(costs: CostModel, stage_speeds: Sequence[float]) -> CostModel:
    """``costs`` with each stage's compute divided by the speed of the rank that holds it."""

    def by_speed(values: tuple[float, ...]) -> tuple[float, ...]:
        return tuple(v / s for v, s in zip(values, stage_speeds))

    return replace(
        costs,
        forward=by_speed(costs.forward),
        backward_input=by_speed(costs.backward_input),
        backward_weight=by_speed(costs.backward_weight),
        backward_full=by_speed(costs.backward_full) if costs.backward_full else (),
    )
