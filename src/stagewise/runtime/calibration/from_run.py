"""The cost model recalibrated from the run, and a slow rank named (issue 49 items 2 and 3): the runtime half.

Every rank calls :meth:`RunCalibrator.observe` after each ``train_step`` (a collective: it gathers the
step's timeline of every rank on one clock, ``pipe.timeline(gather=True)``). The first :data:`WARMUP` steps
are left out (the first step learns shapes, fills the allocator's caches and warms the dispatcher; the fidelity
benchmark leaves out two for the same reason, and the held-out benchmark's smoke run, calibrated after one,
found its calibrating steps 1.5-1.8x the model where later steps ran near it); the next :data:`AFTER` steps calibrate
(:func:`stagewise.planning.recalibrate.calibrate_run`: three, so that the median outvotes one step a
neighbour preempted, and no more, so that a job learns its costs in its first seconds). From then on each
step is checked against the calibration: its measured time against the predicted step and interval
(:meth:`RunCalibrator.report`), each rank's speed against the calibrated layer costs
(:mod:`stagewise.planning.stragglers`): a rank named slow gets one warning line on rank 0 with its measured
slowdown and the cut the planner would choose for the speeds measured (applying it live waits for the
re-layout: a re-plan would call ``pipe.relayout(plan=...)`` with that cut).

What happened is kept as plain records (``records``: dicts with ``"event"``: ``"recalibrated"``,
``"straggler named"``, ``"straggler recovered"``), and given to ``on_event`` as it happens, for a logger.
"""

from __future__ import annotations

import logging
import math
import os
import statistics
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, NamedTuple

from ...ir import Timeline
from ...partition import LayerCost, LayerProfile
from ...planning import Calibration
from ...planning.capped import held_speed
from ...planning.recalibrate import Prediction, RunCalibration, calibrate_run, ring_synced
from ...planning.stragglers import Detector, Straggler, cut_for_speeds, rank_speeds, slowed
from ..assembly.combinations import refuse_unwatchable
from ..comm.groups import global_ranks, initialized
from ..measure.cores import node_layout
from .arguments import refuse_bad_arguments
from .replicas import ReplicaSyncs

log = logging.getLogger(__name__)

#: steps left out before calibrating (module docstring)
WARMUP = 2
#: steps calibrated on (module docstring)
AFTER = 3


class RunCalibrator:
    """Recalibrates the cost model of ``pipe``'s plan from its own steps and watches for a slow rank.

    ``prior``: the layers' costs the calibration scales (``pipe.layer_profile`` when it was cut by a profile;
    otherwise, built before the first step (on every rank alike: the pricing is then a collective of the first
    step), the layers priced on the first batch as the default cut prices them;
    otherwise every layer of a stage alike, which predicts other schedules and micro-batch counts of this cut
    but prices a layer moved between stages at its stage's average: :attr:`prior`); ``cores``: what the node's
    processes share (default: the CPUs any
    rank on this node may run on, gathered from every rank's affinity when it calibrates and recorded
    (``affinity``, ``pinned``): ranks pinned a core each share those cores, not one;
    :mod:`stagewise.planning.core_share`); ``processes``: how many processes compute on them (default: the ranks);
    ``speeds``: each rank's known speed while it calibrates (a re-plan's, after a straggler was named), so that
    a slow rank's slowness stays its speed and is not taken for its layers' cost; ``caps``: each rank's cap (its
    probed share of a core; 1: none): a rank below 1 is held by a quota, and its speed is not told but measured
    from the calibrating steps (:func:`~stagewise.planning.capped.held_speed`); ``bandwidth``: the link's
    bytes/s where the run's transfers cannot identify it (one message size), by default the link the
    pipeline's plan was searched with (``Pipeline.from_plan`` of a plan searched with ``sw.calibrate()``'s
    links: its ``costs.bandwidth``), or a probe's: a number (e.g. a ping-pong's,
    :func:`~stagewise.runtime.measure.links.ping_pong`) or a :class:`~stagewise.planning.Calibration` (its inter link
    between machines, its intra link inside one);
    infinite when none is known (:func:`link_prior`; the record's ``link`` and ``bandwidth_from`` say which);
    ``per_action``: what the model misses of this plan's step is a CPU cost per compute action and per message it
    posts on the shared cores (:mod:`stagewise.planning.action_cost`; the record's ``overhead_s`` and
    ``message_overhead_s``), not a factor on every step;
    ``reduce``: the replicas' all-reduce link ``(latency, bandwidth)``, probed apart
    (:func:`~stagewise.runtime.measure.links.all_reduce_link`): with dp > 1 each stage's SYNC is priced on it;
    ``reduce_cpu``: where it was probed with each replica group alone (``all_reduce_link(alone=True)``: replicas
    inside one machine, on CPUs), the share of a SYNC that is its node's CPU work
    (:func:`~stagewise.runtime.measure.links.all_reduce_cpu`), which takes the shared cores in the prediction;
    ``link_cpu``: the share of a core a message between machines takes at each end while it is on the link
    (:func:`~stagewise.runtime.measure.links.link_cpu`), which the prediction's transfers take from the compute;
    by default the ``bandwidth`` calibration's (:attr:`~stagewise.planning.Calibration.link_cpu`), else the
    pipeline's plan's (a plan searched with it keeps it in ``costs``), else 0 (:func:`link_cpu_prior`).
    The held-out benchmark (``benchmarks/calibration``) calibrates with ``per_action=True``, ``reduce`` and each
    step timed (:meth:`observe`'s ``step_s``): its figures are this calibrator's model.
    """

    def __init__(
        self,
        pipe: Any,
        prior: LayerProfile | None = None,
        *,
        cores: float | None = None,
        processes: int | None = None,
        warmup: int = WARMUP,
        after: int = AFTER,
        on_event: Callable[[dict[str, Any]], None] | None = None,
        speeds: Sequence[float] | None = None,
        caps: Sequence[float] | None = None,
        bandwidth: float | Calibration | None = None,
        per_action: bool = False,
        reduce: tuple[float, float] | None = None,
        reduce_cpu: float = 0.0,
        link_cpu: float | None = None,
    ) -> None:
        refuse_unwatchable("RunCalibrator", pipe)
        refuse_bad_arguments(pipe.num_ranks, after, warmup, cores, processes, speeds, caps, reduce_cpu)
        self.pipe = pipe
        self.counts = [len(r) for r in pipe.layer_ranges]
        self._prior = prior or pipe.layer_profile
        if self._prior is None and getattr(pipe, "train_steps", 1) == 0:  # priced at the first batch, every rank
            pipe.prior_wanted = True  # alike (:func:`stagewise.runtime.frontends.first_batch.at_first_batch`)
        self._cores_given = cores is not None  # else the node's, from every rank's affinity (a collective)
        self.cores = float(cores if cores is not None else len(os.sched_getaffinity(0)))
        self.processes = processes or pipe.num_ranks
        self.speeds = None if speeds is None else [float(x) for x in speeds]
        self.caps = [1.0] * pipe.num_ranks if caps is None else [float(c) for c in caps]
        self.warmup, self.after, self.per_action = warmup, after, per_action
        self.reduce = None if reduce is None else (float(reduce[0]), float(reduce[1]))
        self.reduce_cpu = float(reduce_cpu)
        self.link_cpu = link_cpu_prior(pipe, bandwidth) if link_cpu is None else float(link_cpu)
        if not 0 <= self.link_cpu <= 1:
            raise ValueError(f"RunCalibrator: link_cpu is a share of a core, in [0, 1], got {link_cpu!r}")
        self.bandwidth, self.local_bandwidth, self.bandwidth_from = link_prior(pipe, bandwidth)
        self.on_event = on_event
        self.records: list[dict[str, Any]] = []
        self.calibration: RunCalibration | None = None
        self.prediction: Prediction | None = None
        self.detector = Detector(pipe.num_ranks)
        self._seen = 0
        self._calibrating: list[Timeline] = []
        self._timed: list[float | None] = []  # the calibrating steps' measured seconds, where the caller timed them
        self._steps_timed = False  # whether the calibration took its steps from them
        self._replicas = ReplicaSyncs(pipe)  # dp > 1: the replicas' all-reduces, for the link fit
        self._since: list[float] = []
        #: every step's makespan after the warm-up (the calibrating steps and those since), seconds
        self.makespans: list[float] = []
        #: the CPUs of each rank on this node, read when calibrating without ``cores`` (a collective of every rank;
        #: a Replanner's lead tells the others to join it)
        self.affinity: Callable[[], tuple[list[list[int]], list[str]]] = lambda: node_layout(
            self.pipe.transport.guard.wait
        )  # and each global rank's machine, from the same gather
        #: the last watched step's speeds of every rank, from when each action could start (``rank_speeds``)
        self.spans: list[float] = []

    @property
    def prior(self) -> LayerProfile:
        """The layers' costs the calibration scales: as given, else the profile the pipeline was cut by, else the
        layers priced at its first batch (built before it), else every layer of a stage alike. Fixed once the
        pipeline has stepped: a re-layout's pipeline has no profile of its own."""
        if self._prior is None:
            profile = self.pipe.layer_profile
            if profile is None and getattr(self.pipe, "train_steps", 1) == 0:
                return flat_profile(self.counts)  # not yet priced: the first batch may still price it
            self._prior = profile or flat_profile(self.counts)
        return self._prior

    def observe(self, timeline: Timeline | None = None, *, step_s: float | None = None) -> None:
        """After a train step, on every rank: ``timeline`` (all ranks on one clock), else the pipeline's last
        step gathered (a collective). ``step_s``: the step as the caller measured it (e.g. the slowest rank's
        ``train_step`` from a barrier, which holds what each rank does outside its actions); when every
        calibrating step has one, the bias, the spread and :meth:`report`'s measured steps are taken against
        those, else against the timelines' makespans."""
        if timeline is None:
            timeline = self.pipe.timeline(gather=True)
        if step_s is not None and not step_s > 0:
            raise ValueError(f"RunCalibrator.observe: step_s must be > 0 seconds, got {step_s!r}")
        self._seen += 1
        if self._seen <= self.warmup:
            return
        self.makespans.append(timeline.makespan)
        if self.calibration is None:
            self._calibrating.append(timeline)
            self._timed.append(step_s)
            self._replicas.observe()
            if len(self._calibrating) == self.after:
                self._calibrate()
            return
        self._since.append(step_s if self._steps_timed and step_s is not None else timeline.makespan)
        self._watch(timeline)

    def _calibrate(self) -> None:
        schedule = self.pipe.schedule
        reductions = self._replicas.pairs()
        timed = [s for s in self._timed if s is not None]
        self._steps_timed = len(timed) == len(self._calibrating)
        affinity, nodes, machines = (None, None, []) if self._cores_given else self._layout()
        tied = getattr(getattr(self.pipe, "tied", None), "layer_sets", ())  # (a fake pipeline has no tied sums)
        spans = nodes is not None and len(set(nodes)) > 1  # else every transfer is inside one machine
        cal = calibrate_run(
            self._calibrating, schedule, self.prior, self.counts, None if affinity else self.cores,
            self.bandwidth if spans else self.local_bandwidth, dp=self._replicas.dp, reductions=reductions,
            per_action=self.per_action, steps=timed if self._steps_timed else None, reduce=self.reduce,
            affinity=affinity, nodes=nodes, tied=tied, local_bandwidth=self.local_bandwidth,
            replicas_inside=spans and replicas_inside(self.pipe, machines), reduce_cpu=self.reduce_cpu,
            link_cpu=self.link_cpu,
        )  # fmt: skip
        self.cores = cal.cores
        if any(c < 1 for c in self.caps):  # a held rank's speed on this cut, measured here (not another cut's)
            told = self.speeds or [1.0] * self.pipe.num_ranks
            self.speeds = [
                held_speed(self._calibrating, r, c, cal.cores) if c < 1 else t
                for r, (t, c) in enumerate(zip(told, self.caps))
            ]
        if self.speeds is not None:  # a rank known slow stays a slow rank: its stages' layers keep their costs
            at = [self.speeds[r] for r in schedule.placement]
            measured = {k: {s: v * at[s] for s, v in by.items()} for k, by in cal.measured.items()}
            cal = replace(cal, measured=measured)
        self.calibration = cal
        costs = ring_synced(cal.profile(self.prior).cost_model(_bounds(self.counts)), self._replicas.dp, cal)
        if self.speeds is not None:  # the plan as it runs: its slow rank still slow
            costs = slowed(costs, [self.speeds[r] for r in schedule.placement])
        sums = cal.tied_sums(self.counts, schedule, self._replicas.dp, nodes)
        self.prediction = cal.predict(schedule, costs, self.processes, nodes, tied=sums)
        self.emit(
            {
                "event": "recalibrated",
                "steps": len(self._calibrating),
                "predicted_s": self.prediction.step,
                "interval_s": [self.prediction.low, self.prediction.high],
                "latency_s": cal.latency,
                "bandwidth_Bps": cal.bandwidth,
                "link": cal.link,
                "bandwidth_from": self.bandwidth_from,
                "bias": cal.bias,
                "overhead_s": cal.overhead,
                "message_overhead_s": cal.message_overhead,
                "cores": cal.cores,
                "affinity": [list(a) for a in cal.affinity] or None,
                "nodes": list(cal.nodes) or None,
                "local_link": None if cal.local is None else list(cal.local),
                "replicas_inside": cal.replicas_inside,
                "pinned": cal.pinned,
                "steps_s": list(cal.steps),
                "steps_from": "timed" if self._steps_timed else "makespans",
                "reduce_link": None if cal.reduce is None else list(cal.reduce),
                "reduce_cpu": cal.reduce_cpu,
                "link_cpu": cal.link_cpu,
                "speeds": self.speeds,
            }
        )

    def _layout(self) -> tuple[list[list[int]], list[int] | None, list[str]]:
        """This node's ranks' CPUs, each pipeline rank's machine (numbered in order of first appearance; None
        where the pipeline's global ranks are not known, as on a fake pipeline without a group), and each global
        rank's machine."""
        affinity, machines = self.affinity()
        try:
            ranks = global_ranks(self.pipe.transport.group) if initialized() else list(range(self.pipe.num_ranks))
        except (AttributeError, ValueError, RuntimeError):
            return affinity, None, machines
        if len(ranks) != self.pipe.num_ranks or max(ranks) >= len(machines):
            return affinity, None, machines
        number: dict[str, int] = {}
        return affinity, [number.setdefault(machines[g], len(number)) for g in ranks], machines

    def _watch(self, timeline: Timeline) -> None:
        cal = self.calibration
        assert cal is not None
        self.spans = rank_speeds(timeline, cal, self.pipe.num_ranks)
        slow, back = self.detector.observe(self.spans)
        for r in slow:
            found = self.straggler(r)
            if self.pipe.rank == 0:
                log.warning("%s", found.line())
            self.emit(
                {
                    "event": "straggler named",
                    "rank": r,
                    "speed": found.speed,
                    "speeds": list(found.speeds),
                    "cut": list(found.counts),
                    "predicted_now_s": found.now,
                    "predicted_after_s": found.after,
                }
            )
        for r in back:
            self.emit({"event": "straggler recovered", "rank": r, "speeds": self.detector.speeds()})

    def straggler(self, rank: int) -> Straggler:
        """What is known of ``rank`` now: its speed over the window that names it (the median of its last
        :data:`~stagewise.planning.stragglers.WINDOW`: a line saying 0.93x of a rank named below 0.8 read its last
        3 steps, 2026-12-04 11:12), and the cut for every rank's recent speeds."""
        cal = self.calibration
        if cal is None:
            raise ValueError("RunCalibrator.straggler: not calibrated yet (observe more steps)")
        speeds = self.detector.speeds()
        counts, now, after = cut_for_speeds(cal.profile(self.prior), self.pipe.schedule, self.counts, speeds, cal)
        history = self.detector.history[rank]
        speed = statistics.median(history) if history else speeds[rank]
        return Straggler(rank, speed, tuple(speeds), tuple(counts), now, after)

    def report(self) -> dict[str, Any]:
        """The prediction for this plan, the measured step (median of the steps since calibrating), the error,
        the interval and the share of those steps inside it; None figures before calibration."""
        p = self.prediction
        if p is None or not self._since:
            return {
                "predicted_s": None if p is None else p.step,
                "measured_s": None,
                "error": None,
                "interval_s": None if p is None else [p.low, p.high],
                "inside": None,
                "steps": 0,
            }
        measured = statistics.median(self._since)
        inside = sum(1 for s in self._since if p.low <= s <= p.high) / len(self._since)
        return {
            "predicted_s": p.step,
            "measured_s": measured,
            "error": p.step / measured - 1,
            "interval_s": [p.low, p.high],
            "inside": inside,
            "steps": len(self._since),
        }

    def emit(self, record: dict[str, Any]) -> None:
        """``record`` kept and given to ``on_event`` (a Replanner's lead hands its records to the other ranks)."""
        self.records.append(record)
        if self.on_event is not None:
            self.on_event(record)


def replicas_inside(pipe: Any, machines: Sequence[str]) -> bool:
    """Whether each data-parallel group of ``pipe``'s mesh lies on one machine (``machines``: each global rank's):
    its all-reduce then runs on the link inside a machine, and its messages fit that link, not the one between
    machines (a 100 Mbit link priced a local ring's SYNC at half a second, issue 49)."""
    mesh = getattr(getattr(getattr(pipe, "hybrid", None), "mesh", None), "device_mesh", None)
    if mesh is None or "dp" not in (mesh.mesh_dim_names or ()):
        return False
    ranks = mesh.mesh.movedim(mesh.mesh_dim_names.index("dp"), -1)
    groups = ranks.reshape(-1, ranks.shape[-1]).tolist()
    return all(g < len(machines) for grp in groups for g in grp) and all(
        len({machines[g] for g in grp}) == 1 for grp in groups
    )


class LinkPriors(NamedTuple):
    """The bandwidths (bytes/s) the link fit keeps where the run's transfers cannot identify one: ``between``
    machines and ``inside`` one, and where they came from."""

    between: float
    inside: float
    source: str


def link_prior(pipe: Any, given: float | Calibration | None = None) -> LinkPriors:
    """The link fit's prior bandwidths (:class:`LinkPriors`): ``given`` (a number, for both links; or a
    :class:`~stagewise.planning.Calibration`'s links: its inter link between machines, its intra link inside one
    and between them where it measured no inter), else the links the pipeline's plan was searched with
    (``Pipeline.from_plan``: the plan's ``costs.bandwidth`` and, where it placed ranks on machines,
    ``costs.local_bandwidth``; finite when the plan had measured links), else infinite. Two, because a ping-pong
    inside a machine reads loopback: kept for the link between machines it priced a 100 Mbit link at 4.2 GB/s
    (issue 49)."""
    if isinstance(given, Calibration):
        if given.intra is None and given.inter is None:
            return LinkPriors(math.inf, math.inf, "none (the calibration measured no link)")
        intra = given.intra or given.inter
        inter = given.inter or given.intra
        assert intra is not None and inter is not None
        which = " and ".join(n for n, x in (("inter", given.inter), ("intra", given.intra)) if x is not None)
        return LinkPriors(float(inter.bandwidth), float(intra.bandwidth), f"the calibration's {which} link")
    if given is not None:
        if not float(given) > 0:
            raise ValueError(f"RunCalibrator: bandwidth must be > 0 bytes/s, got {given!r}")
        return LinkPriors(float(given), float(given), "given")
    costs = _plan_costs(pipe)
    if costs is not None and math.isfinite(costs.bandwidth) and costs.bandwidth > 0:
        local = float(getattr(costs, "local_bandwidth", math.inf))
        inside = local if getattr(costs, "rank_nodes", ()) and local > 0 else float(costs.bandwidth)
        return LinkPriors(float(costs.bandwidth), inside, "the plan's link")
    return LinkPriors(math.inf, math.inf, "none")


def link_cpu_prior(pipe: Any, given: float | Calibration | None = None) -> float:
    """A message's CPU share between machines where the caller gives none: ``given``'s (a probed
    :class:`~stagewise.planning.Calibration`), else the plan the pipeline was built from (its ``costs``), else 0."""
    if isinstance(given, Calibration):
        return float(given.link_cpu)
    return float(getattr(_plan_costs(pipe), "link_cpu", 0.0) or 0.0)


def _plan_costs(pipe: Any) -> Any:
    """The cost model of the plan the pipeline was built from (``Pipeline.from_plan``), else None."""
    return getattr(getattr(getattr(pipe, "frontend", None), "plan", None), "costs", None)


def _bounds(counts: list[int]) -> list[int]:
    out = [0]
    for c in counts:
        out.append(out[-1] + c)
    return out


def flat_profile(counts: list[int]) -> LayerProfile:
    """Every layer alike (a unit of each kind): the calibration then spreads a stage's cost evenly over it."""
    layer = LayerCost("layer", 1.0, 0.5, 0.5, 1.0, 0.0, 0.0, 0.0, 0.0)
    return LayerProfile(layers=(layer,) * sum(counts), device="unknown", repeats=0, warmup=0)
