"""A rank held by a CPU quota, priced by its cap (issue 49 item 4): pure arithmetic on the calibrated layers.

A quota (cgroup ``cpu.cfs_quota_us``) is a cap on a rank's share of a core, not a speed: a rank given little work
stays under it and runs at full speed, one given much is slowed to it. Priced as a constant speed (the speed
measured on the running cut), the model under-prices the cut running and over-prices the cuts that relieve the
rank (the 16:15 quiet run: [7, 3] predicted 164 ms, measured 200 ms, so the move to [9, 1] was refused twice).
:func:`priced` gives a cut's step and each rank's speed on it with a held rank's compute capped, every cut (the
running one too) by the same model, so that a gain compares like with like. :func:`slowed` is the one cost model
with a speed per rank (HetPipe's ``speeds=``). :func:`held_speed` is the same cap read the other way, on a
measured step: what a calibration of a new cut must divide a held rank's actions by (measured, never predicted).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import replace

from ..ir import Kind, Schedule, Timeline
from ..partition import LayerProfile
from ..simulation import CostModel, simulate
from .link_fit import COMPUTE
from .recalibrate import RunCalibration, deshared

#: a capped rank's speed (:func:`priced`) is found to 2^-16 of its bracket, far inside any step's noise
CAP_ITERATIONS = 16


def priced(
    calibrated: LayerProfile,
    schedule: Schedule,
    counts: Sequence[int],
    speeds: Sequence[float],
    calibration: RunCalibration,
    caps: Sequence[float] | None = None,
) -> tuple[float, list[float]]:
    """(the predicted step of the cut ``counts``, each rank's speed in it). A rank whose ``caps`` (its probed share
    of a core) is below 1 is held by a quota, a cap and not a speed: over the part of the step in which it has work
    (from its first action to its last: a quota refills every period and lapses unused, so the step's lead-in and
    tail, spent waiting for its peers, give it nothing) it gets at most ``cap`` of a core, so that span must be at
    least ``B / cap``, ``B`` its compute at full speed on this cut. Given little work, it meets that at full speed
    (the step is set by its peers); given much, it is slowed until its span reaches ``B / cap`` (its speed found by
    bisection: a lower speed, a longer step). The other ranks run at ``speeds``. One cost model (the calibrated
    layers), each rank's speed apart: HetPipe's ``speeds=``."""
    bounds = [0]
    for c in counts:
        bounds.append(bounds[-1] + int(c))
    costs = calibrated.cost_model(bounds)
    tied = calibration.tied_sums(counts, schedule)

    def step(rank_speeds: Sequence[float]) -> float:
        slow = slowed(costs, [rank_speeds[r] for r in schedule.placement])
        return calibration.predict(schedule, slow, tied=tied).step

    held = [r for r, c in enumerate(caps or ()) if c < 1]
    out = [1.0 if r in held else float(s) for r, s in enumerate(speeds)]
    if held:
        assert caps is not None
        busy = _busy(costs, schedule, len(out), calibration.bias)
        idle = _idle(costs, schedule, len(out), calibration)
        for _ in range(1 if len(held) == 1 else 3):  # several capped ranks: each in turn, the others held
            for r in held:
                out[r] = _capped_speed(step, out, r, busy[r] / caps[r] + idle[r], caps[r])
    return step(out), out


def held_speed(timelines: Sequence[Timeline], rank: int, cap: float, cores: float) -> float:
    """A rank held to ``cap`` of a core, its speed inside its compute actions in ``timelines`` (the median over the
    steps): between its first compute action and its last (``span``) it got at most ``cap`` of a core, so its
    actions' work at full speed is at most ``cap x span`` and at most their measured seconds ``A`` (de-shared):
    ``min(1, cap x span / A)``. Given little work it stays under its cap (speed 1, its layers as measured); given
    much, it spends its quota and its actions hold the stops (the quota's stops outside them, and its other work,
    read as work: a speed a little high, its layers a little costly, never cheap). Measured on the cut it
    describes, because a speed predicted from another cut's layer costs (each a stage's average) was wrong by as
    much as those averages: 2026-12-03 04:43, told 0.2 on [8, 2] where the held rank ran at full speed, its layers
    read 5x cheap and a layer moved back onto it."""
    if not 0 < cap <= 1:
        raise ValueError(f"held_speed: cap must be in (0, 1], got {cap!r}")
    out = []
    for timeline in timelines:
        own = [(e, s) for e, s in deshared(timeline, cores) if e.rank == rank]
        took = sum(s for _, s in own)
        if not own or took <= 0:
            continue
        span = max(e.end for e, _ in own) - min(e.start for e, _ in own)
        out.append(min(1.0, cap * span / took))
    return statistics.median(out) if out else 1.0


def _capped_speed(
    step: Callable[[Sequence[float]], float], speeds: list[float], r: int, least: float, cap: float
) -> float:
    """Rank ``r``'s speed under its cap: 1 if the step at full speed is at least ``least`` (``B / cap``), else
    the speed at which it is (the step falls as the speed rises; at the cap itself the rank alone takes ``B /
    cap``, so the root lies in ``[cap, 1]``).

    Found in the rank's time per unit of work, ``x = 1 / speed``, in which the step is a longest path of terms
    ``a + b x``: piecewise linear and rising. Regula falsi with the Illinois step (the end that stays put has its
    value halved) keeps the bracket and lands on a linear piece's root in a few steps: 3-6 simulations of the step
    where bisection took 17 (a decision with a capped rank cost rank 0 10-57 ms, most of it here: 2026-12-04).
    The speed returned is the bracket's end at which the rank meets its cap (the step at least ``least``)."""

    def gap(x: float) -> float:  # the step at x less least: rising in x
        return step([1.0 / x if k == r else s for k, s in enumerate(speeds)]) - least

    fa = gap(1.0)
    if fa >= 0:
        return 1.0
    a, b = 1.0, 1.0 / max(cap, 1e-6)
    fb = gap(b)
    if fb <= 0:  # met only at the cap, or not even there: the cap
        return 1.0 / b
    width, side = (b - a) * 2.0**-CAP_ITERATIONS, 0
    for _ in range(4 * CAP_ITERATIONS):  # a bound only: the bracket or the root ends it first
        x = (a * fb - b * fa) / (fb - fa) if fb != fa else (a + b) / 2
        if not a < x < b:
            x = (a + b) / 2
        fx = gap(x)
        if fx >= 0:
            b, fb = x, fx
            fa, side = (fa / 2 if side == 1 else fa), 1
        else:
            a, fa = x, fx
            fb, side = (fb / 2 if side == -1 else fb), -1
        if fx == 0 or b - a <= width:
            break
    return 1.0 / b


def _idle(costs: CostModel, schedule: Schedule, num_ranks: int, calibration: RunCalibration) -> list[float]:
    """Each rank's seconds of the step before its first compute action and after its last, every rank at full
    speed (times the calibration's bias): the lead-in and tail in which a quota gives it nothing to spend."""
    timeline = simulate(schedule, replace(costs, latency=calibration.latency, bandwidth=calibration.bandwidth)).timeline
    compute = [e for e in timeline.events if e.action.kind in COMPUTE]
    if not compute:
        return [0.0] * num_ranks
    begin, end = min(e.start for e in compute), max(e.end for e in compute)
    out = []
    for r in range(num_ranks):
        own = [e for e in compute if e.rank == r]
        out.append(
            ((min(e.start for e in own) - begin) + (end - max(e.end for e in own))) * calibration.bias if own else 0.0
        )
    return out


def _busy(costs: CostModel, schedule: Schedule, num_ranks: int, bias: float) -> list[float]:
    """Each rank's compute seconds in a step at full speed (its actions' costs, times the calibration's bias)."""
    out = [0.0] * num_ranks
    for r, actions in enumerate(schedule.ranks):
        for a in actions:
            s = a.stage
            if a.kind is Kind.F:
                x = costs.forward[s]
            elif a.kind is Kind.B:
                x = (
                    costs.backward_full[s]
                    if costs.backward_full
                    else costs.backward_input[s] + costs.backward_weight[s]
                )
            else:
                x = {Kind.I: costs.backward_input, Kind.W: costs.backward_weight}.get(a.kind, (0.0,) * (s + 1))[s]
            out[r] += x * bias
    return out


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
