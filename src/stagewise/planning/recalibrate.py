"""The cost model recalibrated from the run's own timeline (issue 49 item 2): pure arithmetic, no torch.

A profile is taken in one process alone; in a pipeline the same layers run slower (other processes share the
cores, caches are colder) and every action costs what the profile cannot see. So after a few steps the
runtime hands every rank's events on one clock (``pipe.timeline(gather=True)``, a
:class:`~stagewise.ir.Timeline` per step) to :func:`calibrate_run`, which measures:

* **per stage and kind** (F, B, I, W) the seconds an action takes *on a core of its own*: a compute event
  (it starts when its input has arrived) during which ``n`` ranks compute on ``c`` cores advanced at
  ``min(1, c / n)`` (:func:`deshared`, the same processor sharing :func:`stagewise.simulation.shared_makespan`
  replays), so its own cost is the integral of that rate over the event, not its length;
* **the link**: a receiving rank that sat idle until a compute action's input arrived shows the transfer's
  time, from the producing action's end to the consumer's start; ``latency + bytes / bandwidth`` is fitted
  through those delays and the bytes each message carries (:func:`stagewise.planning.link_fit.fit_link`),
  the bandwidth only where the run's message sizes identify it (else the prior's, said in ``link``);
* **the step**: each timeline's makespan; the model's own miss on the run (the measured median over the
  model's prediction of the same plan: what it cannot see of the step, SYNC and STEP and the interpreter)
  becomes a factor every prediction carries; the interval holds what the run shows of the error
  (:attr:`RunCalibration.error`: the steps' spread, the stage costs' standard error, one stage's scale against
  the others', the model's miss on the run).

Held out: a plan Q is predicted from the calibrated *layers* (:meth:`RunCalibration.profile`: each layer's
profiled costs scaled by what its stage measured in the calibrating run, per kind), cut as Q cuts them, on
Q's ranks sharing the cores, with the calibrated link; nothing of Q is measured. Layers tied across stages (an
embedding and the head reusing it) have their gradients summed over their ranks at the step's end, outside the
action list: each plan waits for that sum as its cut places them (:mod:`stagewise.planning.tied_sum`,
:meth:`RunCalibration.tied_sums`), P too, so the bias does not carry P's sum to every plan.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace

from ..ir import Kind, Schedule, Timeline
from ..partition import LayerProfile
from ..simulation import CostModel, shared_makespan
from .action_cost import Overheads, action_overhead, with_overhead
from .comm import Link
from .core_share import node_cores, pinned, shared_seconds
from .held_out import held_out_costs, layer_bounds, ring_synced
from .link_fit import COMPUTE, fit_link, fit_links
from .run_stages import deshared, stage_holdout_error, stage_medians, stage_spreads
from .tied_sum import TiedSum, tied_bytes, tied_sums

__all__ = [
    "COMPUTE", "Prediction", "RunCalibration", "calibrate_run", "deshared", "fit_link", "fit_links", "held_out_costs",
    "ring_synced", "shared_seconds", "stage_holdout_error",
]  # fmt: skip

#: z for an interval meant to hold 85 % of steps (a normal's 92.5th percentile)
Z85 = 1.44
#: the model's own error on a plan it was not calibrated on, where the calibrating run cannot estimate it (one stage)
MODEL_ERROR = 0.05


@dataclass(frozen=True)
class Prediction:
    """A predicted step (seconds) and the interval meant to hold 85 % of measured steps."""

    step: float
    low: float
    high: float


@dataclass(frozen=True)
class RunCalibration:
    """What the run measured, per stage of its own plan (``counts``: layers per stage), and how it predicts.

    ``measured``: per kind, per stage, seconds on a core of its own; ``steps``: the timelines' makespans;
    ``bias``: measured median step over the model's prediction of the calibrating plan; ``cores``: what the
    node's processes share; ``link``: how the link was fitted (:attr:`~stagewise.planning.link_fit.LinkFit.note`).
    """

    counts: tuple[int, ...]
    measured: dict[Kind, dict[int, float]]
    latency: float
    bandwidth: float
    cores: float
    steps: tuple[float, ...]
    bias: float = 1.0
    link: str = ""
    #: per stage, the relative spread (sample standard deviation over mean) of its compute seconds per step
    #: over the calibrating steps: how far the stage costs this calibration rests on could move
    stage_spread: tuple[float, ...] = ()
    #: seconds (on a core of its own) every compute action brings beyond its layers, measured on the calibrating
    #: run (:func:`~stagewise.planning.action_cost.action_overhead`; 0: the bias alone carries the model's miss)
    overhead: float = 0.0
    #: seconds (on a core of its own) each message a compute action posts to or takes from another rank adds to
    #: it, measured with :attr:`overhead` (:class:`~stagewise.planning.action_cost.Overheads`)
    message_overhead: float = 0.0
    #: the relative error a held-out plan's stage costs carry, estimated on the calibrating run alone
    #: (:func:`stage_holdout_error`: each stage predicted from the other stages' scale); :data:`MODEL_ERROR`
    #: where the run has one stage
    held_out_error: float = MODEL_ERROR
    #: the replicas' all-reduce link ``(latency, bandwidth)`` where it was probed apart from the point-to-point
    #: one (gloo's collectives are not the pipeline's transport); ``None``: the calibrated link
    reduce: tuple[float, float] | None = None
    #: each of the node's ranks' CPUs as the run saw them (``os.sched_getaffinity``), which :attr:`cores` was taken
    #: from (:func:`~stagewise.planning.core_share.node_cores`); empty: not recorded, the cores were given
    affinity: tuple[tuple[int, ...], ...] = ()
    #: the calibrating plan's pipeline ranks' nodes (empty: not given, every transfer on the one link)
    nodes: tuple[int, ...] = ()
    #: the link between two ranks of one node ``(latency, bandwidth)``, fitted through the transfers inside a node
    #: where ``nodes`` put ranks on one node (:attr:`latency` and :attr:`bandwidth` are then the link between
    #: nodes); ``None``: one link for every transfer
    local: tuple[float, float] | None = None
    #: the model's layers tied across stages (:func:`~stagewise.planning.tied_sum.tied_bytes`): each set's layer
    #: indices and the bytes its gradient sum moves; empty: none tied
    tied: tuple[tuple[tuple[int, ...], float], ...] = ()
    #: each pipeline rank's replicas share its machine (the calibrating run's layout): without a probe
    #: (:attr:`reduce`) their all-reduce runs on the :attr:`local` link, not the one between machines
    replicas_inside: bool = False
    #: the share of the replicas' SYNC (timed alone on :attr:`reduce`) that is CPU work of its node (``sync_cpu``)
    reduce_cpu: float = 0.0
    #: the share of a core a message between machines takes at each end while on the link (``link_cpu``, probed:
    #: :func:`~stagewise.runtime.measure.links.link_cpu`); 0: none
    link_cpu: float = 0.0

    @property
    def pinned(self) -> bool | None:
        """Whether the run's ranks had cores of their own (:func:`~stagewise.planning.core_share.pinned`); None: the
        affinity was not recorded."""
        return pinned(self.affinity) if self.affinity else None

    @property
    def measured_step(self) -> float:
        return statistics.median(self.steps)

    @property
    def spread(self) -> float:
        """The steps' relative spread: half the range between the fastest and slowest quarter, over the median."""
        if len(self.steps) < 2:
            return 0.0
        q = statistics.quantiles(self.steps, n=4, method="inclusive")
        return (q[2] - q[0]) / 2 / self.measured_step

    @property
    def uncertainty(self) -> float:
        """The relative error a comparison of two cuts can draw from this calibration alone: each stage's cost
        is a median of ``k`` steps (standard error about ``1.25 sigma / sqrt k``), and moving layers compares two
        stages (``sqrt 2``): ``1.25 sqrt(2 / k)`` x the stages' root-mean-square :attr:`stage_spread`. A fresh
        calibration of 3 steps under a load that moves each rank's speed disagrees with the next by this much,
        which the step-to-step spread of whole steps does not show (issue 49: a re-cut after a release flapped)."""
        if len(self.steps) < 2 or not self.stage_spread:
            return 0.0
        rms = math.sqrt(sum(x * x for x in self.stage_spread) / len(self.stage_spread))
        return 1.25 * math.sqrt(2.0 / len(self.steps)) * rms

    def profile(self, prior: LayerProfile) -> LayerProfile:
        """``prior``'s layers with each kind's cost scaled by what its stage measured over what ``prior`` charges
        it (per stage and kind). A run of whole backwards (B) measured no I or W: they then add up to the measured
        B as the profile splits it (the profile's own I and W, timed apart, are the noisiest of its figures)."""
        out = list(prior.layers)
        start = 0
        for s, c in enumerate(self.counts):
            layers = prior.layers[start : start + c]
            f = _ratio(self.measured, Kind.F, s, sum(x.forward for x in layers))
            b = _ratio(self.measured, Kind.B, s, sum(x.backward for x in layers))
            i = _ratio(self.measured, Kind.I, s, sum(x.backward_input for x in layers))
            w = _ratio(self.measured, Kind.W, s, sum(x.backward_weight for x in layers))
            split = sum(x.backward_input + x.backward_weight for x in layers)
            whole = self.measured.get(Kind.B, {}).get(s)
            if i is None and w is None and whole is not None and split > 0:
                i = w = whole / split  # B measured, I and W not: they share it as the profile splits it
            b = b if b is not None else _either(i, w, f)
            i, w = (i if i is not None else b), (w if w is not None else b)
            for k in range(start, start + c):
                x = prior.layers[k]
                out[k] = replace(
                    x,
                    forward=x.forward * (f or 1.0),
                    backward=x.backward * (b or 1.0),
                    backward_input=x.backward_input * (i or 1.0),
                    backward_weight=x.backward_weight * (w or 1.0),
                )
            start += c
        return replace(prior, layers=tuple(out))

    def predict(
        self,
        schedule: Schedule,
        costs: CostModel,
        processes_per_node: int | None = None,
        nodes: Sequence[int] | None = None,
        *,
        tied: Sequence[TiedSum] = (),
    ) -> Prediction:
        """``schedule`` under ``costs`` (from :meth:`profile`), its ranks sharing :attr:`cores`, the step waiting
        for ``tied`` (the plan's :meth:`tied_sums`); times the bias, with the interval of :data:`Z85` x
        :attr:`error` either way in log (never below 0). ``nodes``: each of the plan's pipeline ranks' node, so
        that a transfer inside one takes the :attr:`local` link."""
        costs = with_overhead(self.linked(costs, nodes), self.overhead, self.message_overhead, schedule.placement)
        p = schedule.num_ranks
        weights = [float(processes_per_node or p) / p] * p
        step = shared_makespan(schedule, costs, weights, self.cores, tied=tied) * self.bias
        width = math.exp(Z85 * self.error)  # the error is of logs: the interval is a factor either way
        return Prediction(step, step / width, step * width)

    def tied_sums(
        self, counts: Sequence[int], schedule: Schedule, dp: int = 1, nodes: Sequence[int] | None = None
    ) -> tuple[TiedSum, ...]:
        """The gradient sums of the :attr:`tied` layers in the plan that cuts them by ``counts`` into ``schedule``'s
        stages, ``dp`` replicas, pipeline ranks on ``nodes`` (:func:`~stagewise.planning.tied_sum.tied_sums`): on the
        calibrated links (between machines and inside one), the replicas alone on :attr:`reduce_link`."""
        local = None if self.local is None else Link(*self.local)
        between = Link(self.latency, self.bandwidth)
        return tied_sums(self.tied, counts, schedule.placement, between=between, local=local,
                         replicas=self.reduce_link, dp=dp, nodes=nodes)  # fmt: skip

    @property
    def reduce_link(self) -> Link:
        """The replicas' all-reduce link: :attr:`reduce` where probed, else the calibrated one they run on (the
        :attr:`local` one where they share a machine)."""
        if self.reduce:
            return Link(*self.reduce)
        return Link(*self.local) if self.replicas_inside and self.local else Link(self.latency, self.bandwidth)

    def linked(self, costs: CostModel, nodes: Sequence[int] | None = None) -> CostModel:
        """``costs`` on the calibrated links: between nodes, and, with ``nodes`` (a plan's pipeline ranks'), inside
        one (the :attr:`local` link; the one link where the calibrating run had no transfer inside a node)."""
        costs = replace(costs, latency=self.latency, bandwidth=self.bandwidth, link_cpu=self.link_cpu)
        if nodes is None:
            return costs
        local = self.local if self.local is not None else (self.latency, self.bandwidth)
        return replace(costs, rank_nodes=tuple(int(x) for x in nodes), local_latency=local[0], local_bandwidth=local[1])

    @property
    def error(self) -> float:
        """The relative error of a held-out prediction, from the calibrating run alone, its independent sources
        combined (root sum of squares): the steps' :attr:`spread`; the stage costs' standard error over the few
        steps (:attr:`uncertainty`); how far one stage's scale misses another's (:attr:`held_out_error`: a plan
        that cuts elsewhere puts layers under another stage's scale); and the model's whole-step miss on the
        calibrating plan (``|log bias|``), which the bias carries to every plan as if it were the same for all."""
        miss = abs(math.log(self.bias)) if self.bias > 0 else 0.0
        return math.sqrt(self.spread**2 + self.uncertainty**2 + self.held_out_error**2 + miss**2)


def _ratio(measured: dict[Kind, dict[int, float]], kind: Kind, stage: int, charged: float) -> float | None:
    seen = measured.get(kind, {}).get(stage)
    if seen is None or charged <= 0:
        return None
    return seen / charged


def _either(*values: float | None) -> float | None:
    return next((v for v in values if v is not None), None)


def _check(
    timelines: Sequence[Timeline], schedule: Schedule, prior: LayerProfile, counts: Sequence[int],
    steps: Sequence[float] | None,
) -> None:  # fmt: skip
    """:func:`calibrate_run`'s arguments, each error naming the value."""
    if not timelines:
        raise ValueError("calibrate_run: no timelines (run a few steps first)")
    if steps is not None and not (len(steps) > 0 and all(x > 0 for x in steps)):
        raise ValueError(f"calibrate_run: steps must be measured step seconds > 0, got {list(steps)!r}")
    if sum(counts) != len(prior) or len(counts) != schedule.num_stages:
        raise ValueError(
            f"calibrate_run: counts {list(counts)} must cut the profile's {len(prior)} layers into "
            f"{schedule.num_stages} stages"
        )


def _cores(cores: float | None, affinity: Sequence[Sequence[int]] | None) -> float:
    """The node's cores: the ranks' ``affinity`` says (:func:`~.core_share.node_cores`), ``cores`` agreeing or
    ``None``; without an affinity, ``cores``."""
    if affinity is not None:
        seen = node_cores(affinity)
        if cores is not None and cores != seen:
            raise ValueError(
                f"calibrate_run: cores {cores} disagree with the ranks' affinity {[sorted(a) for a in affinity]} "
                f"({seen:g} CPUs among them): pass cores=None and let the affinity say"
            )
        return seen
    if cores is None:
        raise ValueError("calibrate_run: give cores (the node's, shared by its ranks) or every rank's affinity")
    return cores


def calibrate_run(
    timelines: Sequence[Timeline],
    schedule: Schedule,
    prior: LayerProfile,
    counts: Sequence[int],
    cores: float | None,
    prior_bandwidth: float = math.inf,
    *,
    dp: int = 1,
    reductions: Sequence[tuple[float, float]] = (),
    per_action: bool = False,
    steps: Sequence[float] | None = None,
    reduce: tuple[float, float] | None = None,
    affinity: Sequence[Sequence[int]] | None = None,
    nodes: Sequence[int] | None = None,
    tied: Sequence[Sequence[int]] = (),
    local_bandwidth: float | None = None,
    replicas_inside: bool = False,
    reduce_cpu: float = 0.0,
    link_cpu: float = 0.0,
) -> RunCalibration:
    """Calibrate on the run of ``schedule`` cut by ``counts`` (layers per stage of ``prior``): ``timelines``
    (one per step, every rank on one clock) measured on ``cores`` shared cores; then the bias against the
    model's own prediction of that plan (module docstring). ``prior_bandwidth`` (bytes/s, e.g. a ping-pong's):
    the link's bandwidth where the run's transfers cannot identify it. With ``dp`` replicas, ``reductions``:
    their all-reduces' per-message pairs (:func:`~stagewise.planning.link_fit.reduce_transfers`), fitted with
    the transfers; the plan's own prediction then prices each stage's SYNC on the fitted link. ``per_action``: a
    compute action also costs its rank's CPU outside compute events (:mod:`.action_cost`); the bias keeps the rest.
    ``steps``: the calibrating plan's steps timed as the plans to predict will be (a whole ``train_step`` from a
    barrier holds what each rank does outside the timeline); the bias and the spread are taken against them
    (default: the makespans). ``reduce``: the replicas' all-reduce link ``(latency, bandwidth)`` probed apart (gloo's
    collectives are not the pipeline's transport), also the plan's own SYNC's, ``reduce_cpu`` of it CPU work on the
    shared cores (:attr:`RunCalibration.reduce_cpu`); ``link_cpu``: :attr:`RunCalibration.link_cpu`. ``affinity``:
    the node's ranks' CPUs, whose union pinned ranks share (``cores`` then theirs, :func:`~.core_share.node_cores`).
    ``nodes``: each pipeline rank's machine: the transfers inside one and between two fitted apart
    (:func:`fit_links`), the one inside on the prior ``local_bandwidth`` (else ``prior_bandwidth``);
    ``replicas_inside``: each rank's replicas share its machine; ``tied``: ``prior``'s layers tied across stages."""
    cores = _cores(cores, affinity)
    _check(timelines, schedule, prior, counts, steps)
    sent = prior.cost_model(bounds := layer_bounds(counts)).output_bytes
    inside = reductions if replicas_inside else ()  # the replicas' all-reduce messages then fit inside a machine
    link, local = fit_links(timelines, schedule, sent, prior_bandwidth, () if inside else reductions, nodes,
                            local_bandwidth, inside)  # fmt: skip
    o = action_overhead(timelines, schedule, cores) if per_action else Overheads(0.0, 0.0)
    run = RunCalibration(
        counts=tuple(int(c) for c in counts), measured=stage_medians(timelines, cores), latency=link.latency,
        bandwidth=link.bandwidth, cores=cores, nodes=() if nodes is None else tuple(int(x) for x in nodes),
        steps=tuple(t.makespan for t in timelines) if steps is None else tuple(float(x) for x in steps),
        link=link.note if local is None else f"between nodes: {link.note}; inside one: {local.note}",
        local=None if local is None else (local.latency, local.bandwidth), reduce_cpu=float(reduce_cpu),
        link_cpu=float(link_cpu), stage_spread=stage_spreads(timelines, cores, schedule.num_stages),
        reduce=None if reduce is None else (float(reduce[0]), float(reduce[1])),
        affinity=() if affinity is None else tuple(tuple(sorted(int(c) for c in a)) for a in affinity),
        tied=tied_bytes(prior, tied), replicas_inside=replicas_inside, overhead=o.action, message_overhead=o.message,
    )  # fmt: skip
    costs = ring_synced(run.profile(prior).cost_model(bounds), dp, run, counts)
    held_out = stage_holdout_error(run.measured, prior.cost_model(bounds))
    run = replace(run, held_out_error=run.held_out_error if held_out is None else held_out)
    own = run.predict(schedule, costs, nodes=nodes, tied=run.tied_sums(counts, schedule, dp, nodes)).step
    return replace(run, bias=run.measured_step / own if own > 0 else 1.0)
