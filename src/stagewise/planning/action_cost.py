"""What a compute action costs beyond its layers' linear share (issue 49: 4 processes on 2 cores), pure.

The quiet regret run (docs/benchmarks/regret.md, 2026-12-02) measured 99 plans at 4 processes on 2 cores
against the calibrated model. Its error, ``log(measured / predicted)``, follows two plan features and not the
data-parallel degree: the micro-batch (``-0.22`` per doubling; plans at 1 sample 33 % slow, at 4 samples 10 %
fast) and the number of actions a step runs (``+0.17`` for the two-virtual-stage schedules, twice the actions
and messages of one stage per rank); with those two, ``dp 2`` adds ``+0.003``. Two terms of the model were
wrong, and this module replaces them:

* **a layer's cost at the plan's micro-batch** was the calibrated cost times the micro-batch ratio (linear);
  a layer call has a fixed part (the operators' dispatch, the autograd graph) and small matrices do not scale
  linearly either. :func:`at_batch` takes how the whole model's cost changes from the calibrating
  micro-batch to the plan's from the layers profiled at both (a probe: one profile per micro-batch size a
  plan space holds) and keeps the layers as the calibrating run measured them;
* **what the run costs beyond its compute** was a factor on the whole step (the bias); part of it is CPU work
  each action brings outside its compute event (the interpreter's dispatch, posting its messages, handing a
  wait to a helper thread and waking up after it), which takes a core as compute does. :func:`action_overhead`
  measures it on the calibrating run's timeline, on a core of its own: each rank's time between its events
  while it was not waiting for an input, per action, and its sends' and receives' posting, per message;
  :func:`with_overhead` adds the first to every compute action and the second to each action for every message
  it posts, so that the processes' sharing of the cores (:func:`stagewise.simulation.shared_makespan`) prices
  them: a plan with twice the actions pays twice, one that crosses ranks at more boundaries pays for its
  messages, a bubble another rank fills does not. The bias keeps what neither term explains.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import NamedTuple

from ..ir import Event, Kind, Schedule, Timeline, boundary_crossings
from ..partition import LayerCost, LayerProfile
from ..simulation import CostModel

__all__ = ["Overheads", "action_overhead", "at_batch", "with_overhead"]

COMPUTE = (Kind.F, Kind.B, Kind.I, Kind.W)


def at_batch(calibrated: LayerProfile, prior: LayerProfile, at: LayerProfile) -> LayerProfile:
    """``calibrated`` (the layers as the calibrating run measured them: :meth:`RunCalibration.profile` of
    ``prior``) moved to the micro-batch ``at`` was profiled at: each layer's forward times the whole model's
    forward in ``at`` over ``prior``, its backward (fused, I and W alike) times the whole model's backward
    ratio; sizes are ``at``'s. The layers' shape stays the run's, measured where it matters; the second profile
    only says how a call's cost changes with the micro-batch, summed over every layer because its single layers
    are its noisiest figures (an I 7x its neighbours under load). Taking ``at``'s own shape instead (each layer
    scaled by its own ratio) ranked plans of one micro-batch worse on the five kept quiet runs (Kendall tau
    over their pairs 0.29 / 0.10 / 0.18 / 0.17 / -0.14 against 0.38 / 0.10 / 0.32 / 0.43 / 0.01)."""
    if not (len(calibrated) == len(prior) == len(at)):
        raise ValueError(
            f"at_batch: the profiles must hold the same layers, got {len(calibrated)}, {len(prior)} and {len(at)}"
        )

    def ratio(cost: Callable[[LayerCost], float]) -> float:
        was = sum(cost(x) for x in prior.layers)
        return sum(cost(x) for x in at.layers) / was if was > 0 else 1.0

    f, b = ratio(lambda x: x.forward), ratio(lambda x: x.backward)
    out = tuple(
        replace(
            a,
            forward=c.forward * f,
            backward=c.backward * b,
            backward_input=c.backward_input * b,
            backward_weight=c.backward_weight * b,
        )
        for c, a in zip(calibrated.layers, at.layers)
    )
    return replace(at, layers=out)


def with_overhead(
    costs: CostModel, seconds: float, message: float = 0.0, placement: Sequence[int] | None = None
) -> CostModel:
    """``costs`` with ``seconds`` (on a core of its own) added to every compute action (F, B fused, I, W), and
    ``message`` more for each message the action posts to or takes from another rank under ``placement`` (each
    stage's rank): an F its input from the stage before and its output to the stage after, a B or an I the
    gradient from the stage after and to the stage before; a W none. A schedule that crosses ranks at every
    stage boundary (interleaved 1F1B) posts 1.5 messages per action, one that keeps half its boundaries on a rank
    (ZB-V) 0.67 (issue 49: the posting spread evenly over the actions priced the first low and the second high)."""
    if not (seconds >= 0 and message >= 0):
        raise ValueError(f"with_overhead: seconds and message must be >= 0, got {seconds!r} and {message!r}")
    if message and placement is None:
        raise ValueError("with_overhead: a message's cost needs the placement (each stage's rank)")
    if seconds == 0 and message == 0:
        return costs
    fused = costs.backward_times()
    n = costs.num_stages
    crossing = [0] * n
    if message:
        assert placement is not None
        if len(placement) != n:
            raise ValueError(f"with_overhead: one rank per stage ({n}), got {len(placement)}")
        crossing = list(boundary_crossings(placement))
    back = [seconds + message * c for c in crossing]  # an F and a B alike take one message each way

    def plus(xs: Sequence[float], extra: Sequence[float]) -> tuple[float, ...]:
        return tuple(x + e for x, e in zip(xs, extra))

    return replace(
        costs,
        forward=plus(costs.forward, back),
        backward_input=plus(costs.backward_input, back),
        backward_weight=plus(costs.backward_weight, [seconds] * n),
        backward_full=plus(fused, back),
    )


class Overheads(NamedTuple):
    """What a compute action costs its rank outside its compute event, on a core of its own: ``action`` seconds
    each (the gaps: the interpreter's dispatch, the wake-up after a wait), ``message`` seconds per message it
    posts (a send's or a receive's posting)."""

    action: float
    message: float


def action_overhead(timelines: Sequence[Timeline], schedule: Schedule, cores: float) -> Overheads:
    """The :class:`Overheads` over ``timelines`` (every rank on one clock, one process per rank): per rank, the
    gaps before compute actions whose input was there when the rank's previous event ended (a gap before a
    waited input holds the wait: left out, and so is that action), per action counted; and the posting of sends
    and receives (communication events), per message posted; the median of each over the timelines (steps). A
    gap or posting while ``n`` other ranks compute ran at ``min(1, cores / (n + 1))``. Each message is charged
    to the action that posts it (:func:`with_overhead`): spreading the posting over every compute action priced
    interleaved 1F1B (1.5 messages an action) 5-8 % low against 1F1B (1) and ZB-V (0.67) high, issue 49."""
    per_step = [_step_overhead(t, schedule, cores) for t in timelines]
    if not per_step:
        return Overheads(0.0, 0.0)
    return Overheads(statistics.median(a for a, _ in per_step), statistics.median(m for _, m in per_step))


def _step_overhead(timeline: Timeline, schedule: Schedule, cores: float) -> tuple[float, float]:
    """One step's gap per counted compute action and posting per message (:func:`action_overhead`)."""
    gaps, counted, posting, messages = 0.0, 0, 0.0, 0
    compute = [e for e in timeline.events if e.action.kind in COMPUTE]
    sent = _inputs_sent(compute, schedule)
    for row in timeline.by_rank():
        last: float | None = None
        for e in row:
            if e.action.kind in COMPUTE:
                if last is not None and sent.get(e, -math.inf) <= last:
                    gaps += _own(last, e.start, e.rank, compute, cores)
                    counted += 1
            elif e.action.kind.is_comm:
                posting += _own(e.start, e.end, e.rank, compute, cores)
                messages += 1
            last = e.end if last is None else max(last, e.end)
    return (gaps / counted if counted else 0.0), (posting / messages if messages else 0.0)


def _inputs_sent(compute: list[Event], schedule: Schedule) -> dict[Event, float]:
    """Per compute event whose input comes from another rank, when that input was sent (its producer's end)."""
    placement, last = schedule.placement, schedule.num_stages - 1
    ends = {(e.action.kind, e.action.stage, e.action.microbatch): e.end for e in compute}
    out = {}
    for e in compute:
        a = e.action
        source = None
        if a.kind is Kind.F and a.stage > 0:
            source = (Kind.F, a.stage - 1, a.microbatch)
        elif a.kind in (Kind.B, Kind.I) and a.stage < last:
            up = (Kind.B, a.stage + 1, a.microbatch)
            source = up if up in ends else (Kind.I, a.stage + 1, a.microbatch)
        if source is not None and source in ends and placement[source[1]] != placement[a.stage]:
            out[e] = ends[source]
    return out


def _own(t0: float, t1: float, rank: int, compute: list[Event], cores: float) -> float:
    """Seconds on a core of its own in ``[t0, t1]`` for ``rank``, while the other ranks' compute events share
    the cores with it."""
    if t1 <= t0:
        return 0.0
    others = [e for e in compute if e.rank != rank and e.start < t1 and e.end > t0]
    edges = sorted({t0, t1, *(t for e in others for t in (e.start, e.end) if t0 < t < t1)})
    own = 0.0
    for a, b in zip(edges, edges[1:]):
        n = sum(1 for e in others if e.start < b and e.end > a)
        own += (b - a) * min(1.0, cores / (n + 1))
    return own
