"""What a compute action costs beyond its layers' linear share (issue 49: 4 processes on 2 cores), pure.

The quiet regret run (docs/benchmarks/regret.md, 2026-12-02) measured 99 plans at 4 processes on 2 cores
against the calibrated model. Its error, ``log(measured / predicted)``, follows two plan features and not the
data-parallel degree: the micro-batch (``-0.22`` per doubling; plans at 1 sample 33 % slow, at 4 samples 10 %
fast) and the number of actions a step runs (``+0.17`` for the two-virtual-stage schedules, twice the actions
and messages of one stage per rank); with those two, ``dp 2`` adds ``+0.003``. Two terms of the model were
wrong, and this module replaces them:

* **a layer's cost at the plan's micro-batch** was the calibrated cost times the micro-batch ratio (linear);
  a layer call has a fixed part (the operators' dispatch, the autograd graph) and small matrices do not scale
  linearly either. :func:`at_batch` takes the layers profiled at the plan's own micro-batch (a probe: one
  profile per micro-batch size a plan space holds) and keeps what the calibrating run taught per stage and
  kind: each layer's calibrated-over-profiled ratio at the calibrating micro-batch;
* **what the run costs beyond its compute** was a factor on the whole step (the bias); it is CPU work each
  action brings (the interpreter's dispatch, posting its messages, handing a wait to a helper thread and
  waking up after it), which takes a core as compute does: :func:`with_overhead` adds ``seconds`` to every
  compute action, so the processes' sharing of the cores (:func:`stagewise.simulation.shared_makespan`) prices
  it, and :func:`fit_overhead` finds the seconds that make the model's replay of the calibrating plan take
  its measured step. A plan with twice the actions pays it twice; a bubble that another rank fills does not.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from ..partition import LayerProfile
from ..simulation import CostModel

__all__ = ["at_batch", "fit_overhead", "with_overhead"]

#: the relative tolerance of :func:`fit_overhead`'s bisection on the step
TOLERANCE = 1e-9


def at_batch(calibrated: LayerProfile, prior: LayerProfile, at: LayerProfile) -> LayerProfile:
    """``at`` (the layers profiled at a plan's micro-batch) with each layer's cost of each kind scaled by
    ``calibrated / prior`` at the calibrating micro-batch (``calibrated``: :meth:`RunCalibration.profile` of
    ``prior``; a kind ``prior`` charges nothing keeps ``at``'s cost). Sizes are ``at``'s."""
    if not (len(calibrated) == len(prior) == len(at)):
        raise ValueError(
            f"at_batch: the profiles must hold the same layers, got {len(calibrated)}, {len(prior)} and {len(at)}"
        )

    def scaled(x: float, was: float, now: float) -> float:
        return x * (now / was) if was > 0 else x

    layers = tuple(
        replace(
            a,
            forward=scaled(a.forward, p.forward, c.forward),
            backward=scaled(a.backward, p.backward, c.backward),
            backward_input=scaled(a.backward_input, p.backward_input, c.backward_input),
            backward_weight=scaled(a.backward_weight, p.backward_weight, c.backward_weight),
        )
        for c, p, a in zip(calibrated.layers, prior.layers, at.layers)
    )
    return replace(at, layers=layers)


def with_overhead(costs: CostModel, seconds: float) -> CostModel:
    """``costs`` with ``seconds`` (on a core of its own) added to every compute action: F, B (fused), I, W."""
    if not seconds >= 0:
        raise ValueError(f"with_overhead: seconds must be >= 0, got {seconds!r}")
    if seconds == 0:
        return costs
    fused = costs.backward_times()

    def plus(xs: tuple[float, ...]) -> tuple[float, ...]:
        return tuple(x + seconds for x in xs)

    return replace(
        costs,
        forward=plus(costs.forward),
        backward_input=plus(costs.backward_input),
        backward_weight=plus(costs.backward_weight),
        backward_full=plus(fused),
    )


def fit_overhead(replay: Callable[[float], float], measured: float, upper: float | None = None) -> float:
    """The per-action seconds ``o >= 0`` with ``replay(o) == measured`` (``replay``: the model's step of the
    calibrating plan with ``o`` added to each compute action, increasing in ``o``); 0 when the model without
    it already takes ``measured`` or more. ``upper``: a bound known to overshoot (default: ``measured``, as no
    action's overhead can exceed the step)."""
    if not measured > 0:
        raise ValueError(f"fit_overhead: measured step must be > 0, got {measured!r}")
    if replay(0.0) >= measured:
        return 0.0
    lo, hi = 0.0, measured if upper is None else upper
    if replay(hi) < measured:
        return hi
    while hi - lo > TOLERANCE * measured:
        mid = (lo + hi) / 2
        if replay(mid) < measured:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2
