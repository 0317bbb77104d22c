"""Re-planned live (issue 49 items 3 and 4): the run's calibration asks whether another plan pays, and applies it.

``Replanner(pipe, steps=N)`` is called on every rank after each ``train_step`` (``observe()``, a collective); one
rank watches for all (:mod:`.lead`), one step in three once the run is settled (:mod:`stagewise.planning.cadence`).
A :class:`~stagewise.runtime.calibration.from_run.RunCalibrator` calibrates; when it calibrates, names a
straggler or clears one, and every ``every`` steps besides, the candidates are built
(for each schedule considered, the cut for the ranks' measured speeds and its predicted step) and the pure
decision asked (:func:`stagewise.planning.replan.decide`: change only when the gain over the steps left exceeds the
re-layout's cost plus a margin drawn from the calibration's uncertainty, the speeds' standard error and the
spread of the last :data:`SPREAD_STEPS` steps; never within ``cooldown`` steps of a change). Its record goes to
every rank, to one log line, to the ``replan`` event of ``pipe.metrics``, to ``log`` and ``log_path``. A change is
applied with :meth:`Pipeline.relayout`; its seconds are the next decision's cost
(:func:`~stagewise.planning.replan.relayout_cost`), and a new calibration starts on the new cut, told the ranks'
speeds inside their compute actions (:func:`~stagewise.planning.stragglers.compute_speeds`), so that a straggler
stays a slow rank rather than becoming costly layers, and its layers move back when it recovers. A CPU quota is
a cap, not a speed: a held rank the re-cut left little work shows neither its cap nor its lift in its steps, so
the held ranks are probed (:mod:`.held`), and the candidates are priced with their compute capped
(:func:`~stagewise.planning.capped.priced`); a lifted rank is taken at full speed and recalibrated.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ...partition import LayerProfile
from ...passes.build import build_like
from ...planning.cadence import SETTLED_EVERY, Cadence, readings_settled
from ...planning.recalibrate import Z85, RunCalibration
from ...planning.replan import (
    NO_BETTER,
    Decisions,
    Option,
    cap_error,
    first_relayout_s,
    line,
    options_for,
    relayout_changes,
    relayout_cost,
    step_spread,
)
from ...planning.stragglers import (
    NOISE_STEPS,
    RECENT,
    SLOW,
    WINDOW,
    compute_speeds,
    decision_errors,
    ratio_error,
    speeds_moved,
)
from ..assembly.combinations import refuse_unwatchable
from ..comm.groups import group_rank
from ..frontends.balance import on_first_rank
from .arguments import refuse_bad_counts
from .from_run import RunCalibrator
from .held import HeldProbes
from .lead import LOOP, RELAYOUT, Sides, lead_for, refuse_replicas
from .probe import pipeline_probes

log = logging.getLogger(__name__)


#: the steps whose step-to-step spread draws the margin (the last ones, across changes of plan: a change is
#: one outlying difference, which the median ignores)
SPREAD_STEPS = 20


class Replanner:
    """Re-plans ``pipe`` live from its own run (module docstring); ``steps``: the job's total train steps.

    ``schedules``: other schedule names to consider at the same ranks and micro-batches (default: the running one
    only, so only the cut moves); ``relayout_s``: the re-layout's cost until one is measured (default: the state
    over the calibrated link and a rebuild, :func:`~stagewise.planning.replan.first_relayout_s`; then the last
    measured, a first one's one-off costs left out, :func:`~stagewise.planning.replan.relayout_cost`); ``every``:
    steps between decisions besides the calibration's news (0: on news only; a slowdown first measured on a window
    not yet full of slow steps is looked at again once it is); the margin a gain must clear beside it is ``z`` x the
    steps' step-to-step spread x the running step x the steps left, plus ``margin_s`` (a fixed part, 0 by default);
    ``guard_calibration``: the margin also holds the calibration's own uncertainty (its stages' spread over its few
    steps, :attr:`~stagewise.planning.recalibrate.RunCalibration.uncertainty`), so that a fresh calibration after a
    change, noisier than the steps' spread says, does not re-cut on its noise; ``probe_every``: steps between loop
    probes of the held ranks (0: never), ``probe`` and ``quota_probe``: every rank's share of a core and CPU quota
    (collectives; default :func:`.probe.probe_shares`, :func:`.probe.quota_shares`; :class:`.held.HeldProbes`).
    ``leader``: one rank (the default group's first) watches for all (:mod:`.lead`): its calibrator calibrates,
    the others keep the decisions, events and speeds it hands them. None (default): a lead where the pipeline's
    ranks are the whole job; False: every rank watches alike. ``settled_every``: once the run is settled, one step
    in this many is watched (:class:`~stagewise.planning.cadence.Cadence`; 1: every step). The pipeline must be
    the whole job (:func:`.lead.refuse_replicas`).
    """

    def __init__(
        self,
        pipe: Any,
        calibrator: RunCalibrator | None = None,
        *,
        steps: int,
        margin_s: float = 0.0,
        z: float = Z85,
        cooldown: int = 10,
        schedules: Sequence[str] = (),
        relayout_s: float | None = None,
        log_path: str | Path | None = None,
        every: int = WINDOW,
        guard_calibration: bool = True,
        probe_every: int = WINDOW,
        probe: Callable[[], list[float]] | None = None,
        quota_probe: Callable[[], list[float | None]] | None = None,
        leader: bool | None = None,
        settled_every: int = SETTLED_EVERY,
    ) -> None:
        refuse_bad_counts(steps, every, probe_every, settled_every, relayout_s)
        refuse_unwatchable("Replanner", pipe)
        refuse_replicas(pipe)
        self.pipe = pipe
        self.calibrator = calibrator or RunCalibrator(pipe)
        self.steps = int(steps)
        self.schedules = tuple(schedules)
        for name in self.schedules:  # a schedule that cannot run here fails now, on every rank, not mid-run
            build_like(name, pipe.schedule, "Replanner: schedules= names ")
        self.relayout_s = relayout_s
        #: the seconds of each re-layout this Replanner applied, in order
        self.relayouts: list[float] = []
        self.log_path = None if log_path is None else Path(log_path)
        self.decisions = Decisions(margin_s=margin_s, cooldown=cooldown, z=z)
        self._seen = self._makespans = 0
        self.every, self.guard_calibration = int(every), bool(guard_calibration)
        self._since_decision, self._stirred, self._at, self.cadence = 0, False, -1, Cadence(int(settled_every))
        self._last: tuple[Any, ...] | None = None  # the last prices and what they were priced with (_prices)
        #: the last :data:`SPREAD_STEPS` steps' makespans (seconds), across changes of plan
        self.steps_seen: list[float] = []
        #: each rank's speed relative to the calibrated layers (1.0 until a straggler is measured), its relative
        #: standard error, and its speed inside its compute actions (what a calibration after a change is told)
        self.speeds: list[float] = [1.0] * pipe.num_ranks
        self.speed_errors, self.told = [0.0] * pipe.num_ranks, [1.0] * pipe.num_ranks
        self._compute: list[list[float]] = []
        #: each rank's last :data:`NOISE_STEPS` speeds, across changes of plan (the machine's step-to-step noise is
        #: not the layout's)
        self.series: list[list[float]] = [[] for _ in range(pipe.num_ranks)]
        loop, quota = pipeline_probes(pipe)
        if probe is not None:  # a probe of the caller's own: no quota unless given too
            loop, quota = probe, quota_probe or (lambda: [None] * pipe.num_ranks)
        self._loop, self._quota = loop, quota_probe or quota  # this rank's side of the probes
        self.lead = lead_for(pipe, self.calibrator, leader, each_step=probe is None and quota_probe is None)
        if self.lead is not None and self.lead.leads:  # the others join what the lead's watch gathers
            loop, quota = self.lead.driven(LOOP, self._loop), self.lead.quota(self._quota)
        self.held = HeldProbes(pipe.num_ranks, int(probe_every), loop, quota if self.lead else self._quota)
        self.caps, self.probes = self.held.caps, self.held.log  # (the same objects: the held ranks' caps, probes)
        self._priced = [1.0] * pipe.num_ranks  # the caps as the last decision priced them

    @property
    def prior(self) -> LayerProfile:
        """The layers' costs the decisions price cuts by (the calibrator's: fixed once the pipeline stepped)."""
        return self.calibrator.prior

    @property
    def log(self) -> list[dict[str, Any]]:
        """Every decision so far, taken or not (plain dicts; :func:`stagewise.planning.replan.replay`)."""
        return self.decisions.log

    def observe(self, timeline: Any = None) -> dict[str, Any] | None:
        """After a train step, on every rank alike (a collective on a watched step; nothing on the others, where
        a settled run returns at once): calibrate, and re-plan when the calibration has news; the decision's record
        (None when nothing was decided). ``timeline``: the step's, every rank on one
        clock (default: gathered from the pipeline; with a lead, the others' events sent to it)."""
        step, lead = int(self.pipe.train_steps), self.lead
        if not self.cadence.due(step):  # a settled run: this step is not watched, on any rank
            return None
        if lead is None:
            record = self._observe(self.pipe.timeline(gather=True) if timeline is None else timeline, step)
            self._pace(step, record)
            return record
        sides = Sides(self._loop, self._quota, self._relayout, self._observe, self._pace)
        return lead.watch(self, timeline, step, sides)

    def _pace(self, step: int, record: dict[str, Any] | None) -> int:
        """The next step to watch (:class:`~stagewise.planning.cadence.Cadence`): this one was quiet when the
        calibration stands, nothing stirred (news, a probe's finding) and every rank's reading agrees with what the
        detector holds of it."""
        cal, taken = self.calibrator, record is not None and record["taken"]
        settled = readings_settled(cal.detector, [c < 1 for c in self.caps.caps()])
        quiet = cal.calibration is not None and not (self._stirred or taken) and settled
        return self.cadence.after(step, quiet)

    def _event(self, name: str, **fields: Any) -> None:
        """An event of ``pipe.metrics``, on every rank (with a lead: handed to the others with its last word)."""
        self.pipe.metrics.event(name, **fields)
        if self.lead is not None:
            self.lead.events.append([name, fields])

    def _observe(self, timeline: Any, step: int) -> dict[str, Any] | None:
        gap, self._at, self._stirred = step - self._at if self._at >= 0 else 1, step, False
        self._probe()
        cal = self.calibrator
        watched = cal.calibration is not None
        cal.observe(timeline)
        if watched and cal.calibration is not None:
            self._watch(timeline, cal.calibration)
        self.steps_seen = (self.steps_seen + cal.makespans[self._makespans :])[-SPREAD_STEPS:]
        self._makespans = len(cal.makespans)
        news = [r for r in cal.records[self._seen :] if r["event"] != "replan"]
        self._seen = len(cal.records)
        self._stirred = self._stirred or bool(news)
        named = [int(r["rank"]) for r in news if r["event"] == "straggler named"]
        if self.held.every and [r for r in named if r not in self._held()]:  # its cap before the first decision
            self._probe(now=named)
            if self.calibrator is not cal:  # that probe freed another rank: a fresh calibration decides
                return None
        self._since_decision += max(1, gap)  # steps, watched or not
        due = self.every > 0 and self._since_decision >= self.every
        if cal.calibration is None or not (news or due or self.caps.moved()):
            return None
        if self.held.since and self._held():  # the caps as of this step: a quota deepened since the last probe
            self._probe(now=self._held())  # priced at its old cap moved work onto the held rank (2026-12-03 04:17)
            if self.calibrator is not cal:  # the probe freed a rank: a fresh calibration (a new calibrator) decides
                return None
        self._since_decision = 0
        self._priced = self.caps.priced_now()  # on every rank alike: moved() is asked on every rank
        decided = self._decide() if self.lead else on_first_rank(None, self._decide, "deciding whether to re-plan")
        record, self.speeds = decided["record"], decided["speeds"]
        self.speed_errors, self.told = decided["errors"], decided["told"]
        self.decisions.keep(record)
        self._tell(record)
        if record["taken"]:
            self._apply(record["best"])
        return record

    def _watch(self, timeline: Any, cal: RunCalibration) -> None:
        """This step's speeds inside the compute actions (what a calibration after a change is told) and from
        when each action could start (their noise: the decision's speed error; the calibrator's reading of this
        step), relative to the fastest rank."""
        inside, spans = compute_speeds(timeline, cal, self.pipe.num_ranks), self.calibrator.spans
        self._compute = (self._compute + [[x / max(max(inside), 1e-12) for x in inside]])[-RECENT:]
        for r, x in enumerate(spans):  # as measured: relative to the fastest, the fastest's would all be 1
            self.series[r] = (self.series[r] + [x])[-NOISE_STEPS:]

    def _held(self) -> list[int]:
        """The ranks held slow: measured slow, or priced by a cap (a capped rank given little work reads fast)."""
        return [r for r, (s, c) in enumerate(zip(self.speeds, self.caps.caps())) if s < SLOW or c < 1]

    def _probe(self, now: Sequence[int] = ()) -> None:
        """Every :attr:`probe_every` steps while a rank is held slow (and at once for the ranks ``now`` named):
        the probe of :class:`.held.HeldProbes`; the held ranks' caps take it; held ones free again
        (:func:`~stagewise.planning.stragglers.lifted`) are taken at full speed, and a fresh calibration on the
        running cut starts (its stage costs measured at that speed), whose news re-decides."""
        found = self.held.take(int(self.pipe.train_steps), self._held(), now)
        if found is None:
            return
        self._stirred = self._stirred or bool(found.free or found.capped or self.held.suspects) or self.caps.moved()
        free, shares, top = found.free, found.shares, found.top
        if found.capped:
            self._named_by_probe(found.capped, [shares[r] / top for r in found.capped])
        if not free:
            return
        for r in free:
            self.speeds[r] = self.told[r] = 1.0
        # The machine changed regime: the held steps' noise (a quota's periods beating against the steps read
        # +-30 % on the 2026-12-04 runs) is not the free machine's. Kept, it held the first decisions' margin
        # above the move back's gain for 10-20 steps. Until the free steps give 3 speeds the freed ranks' speeds
        # are the probe's, and the error is the floor (``decision_errors``): the fresh calibration's spread over the
        # free steps is in the margin already.
        self.series = [[] for _ in self.series]
        self.speed_errors = [math.nan] * len(self.speed_errors)
        if group_rank(None) == 0:
            log.warning(
                "stagewise: rank(s) %s, held slow, probed at %s of a free rank's share of a core: their throttle "
                "lifted; recalibrating at full speed (the cut for equal speeds follows when it pays)",
                free,
                [round(shares[r] / top, 2) for r in free],
            )
        self._event("straggler lifted", step=int(self.pipe.train_steps), ranks=free)
        self._recalibrate()

    def _named_by_probe(self, ranks: list[int], shares: list[float]) -> None:
        """One line and an event for ranks a probe found capped before their steps named them."""
        if group_rank(None) == 0:
            said = f"probed at {[round(s, 2) for s in shares]} of a free rank's share of a core twice running"
            log.warning(
                "stagewise: rank(s) %s %s: held by a quota; the next decision prices them by that cap", ranks, said
            )
        self._event("straggler named", step=int(self.pipe.train_steps), ranks=ranks, by="probe")

    def _decide(self) -> dict[str, Any]:
        """On the first rank: the candidates and the pure decision (not yet logged: every rank logs the same)."""
        cal = self.calibrator
        assert cal.calibration is not None
        step = int(self.pipe.train_steps)
        full = [len(h) == WINDOW for h in cal.detector.history]  # measured where a window is full, else what
        measured = cal.detector.speeds()  # was known when this calibration began
        speeds = [measured[r] if f else self.speeds[r] for r, f in enumerate(full)]
        errs = decision_errors(full, self.speed_errors, self.series)
        told = self.told
        if len(self._compute) == RECENT:  # the same recent steps as the speeds the decision takes
            told = [statistics.median(c[r] for c in self._compute) for r in range(len(told))]
        current, candidates, held, priced_at = self._prices(cal.calibration, speeds, errs, all(full), step)
        capped = [c < 1 for c in self._priced]  # priced by their caps: their measured speeds' noise is not used
        error = math.hypot(ratio_error([0.0 if c else e for e, c in zip(errs, capped)]), held)
        before = len(self.decisions.log), self.decisions.last_change
        record = self.decisions.consider(
            step,
            current,
            candidates,
            steps_left=max(0, self.steps - step),
            relayout_s=self._cost(cal.calibration),
            spread=step_spread(self.steps_seen),
            uncertainty=cal.calibration.uncertainty if self.guard_calibration else 0.0,
            speed_error=error,
            speeds_measured=all(full),
        )
        del self.decisions.log[before[0] :]  # observe() appends the record handed round, on every rank alike
        self.decisions.last_change = before[1]
        if any(c < 1 for c in self._priced):
            record["caps"] = list(self._priced)
        if priced_at != step:
            record["priced_at"] = priced_at
        if record["reason"] != NO_BETTER:  # a gain refused or taken: priced anew next time (the margin's noise)
            self._last = None
        return {"record": record, "speeds": speeds, "errors": errs, "told": told}

    def _prices(self, cal: RunCalibration, speeds: list[float], errs: list[float], full: bool, step: int) -> Any:
        """The plan running and the candidates priced, the held ranks' caps' error on the saving, and the step they
        were priced at: the last decision's again where it found no better plan and what it priced stands (this
        calibration, the same caps, every window full, no rank's speed moved past its noise, ``speeds_moved``),
        since pricing every cut costs rank 0 20-45 ms (2026-12-04 10:50). A gain refused as below its margin is
        priced anew: a fresh reading of noisy speeds is what a marginal change waits for (a run re-cut at step 33
        instead of 20 with the last prices kept)."""
        key = (list(self._priced), self.caps.error())
        last = self._last
        same = last is not None and last[0] is cal and last[1] == key and full and all(map(math.isfinite, errs))
        if same and not speeds_moved(last[2], speeds, errs, self.decisions.z):  # type: ignore[index]
            return last[3]  # type: ignore[index]
        current, candidates = self._options(cal, speeds, self._priced)
        held = 0.0
        if any(c < 1 for c in self._priced):
            plans = [self.pipe.schedule] + [build_like(n, self.pipe.schedule) for n in self.schedules]
            held = cap_error(cal, self.prior, plans, current, candidates, speeds, self._priced, self.caps.error())
        self._last = (cal, key, list(speeds), (current, candidates, held, step)) if full else None
        return current, candidates, held, step

    def _options(self, cal: RunCalibration, speeds: list[float], caps: list[float]) -> tuple[Option, list[Option]]:
        running = self.pipe.schedule
        others = [build_like(n, running) for n in self.schedules if n != running.name]
        counts = [len(r) for r in self.pipe.layer_ranges]
        return options_for(cal, self.prior, running, counts, speeds, others, caps)

    def _cost(self, cal: RunCalibration) -> float:
        predicted = self.relayout_s
        if predicted is None:
            own = sum(p.numel() * p.element_size() for p in self.pipe.parameters())
            predicted = first_relayout_s(own, self.pipe.num_ranks, cal.bandwidth)
        return relayout_cost(self.relayouts, predicted)

    def _tell(self, record: dict[str, Any]) -> None:
        first = group_rank(None) == 0
        if first:
            (log.warning if record["taken"] else log.info)("%s", line(record))
            if self.log_path is not None:
                with self.log_path.open("a") as f:
                    f.write(json.dumps(record) + "\n")
        best = record["best"] or {}
        self._event("replan", step=record["step"], taken=record["taken"], reason=record["reason"],
                    schedule=best.get("schedule"), counts=best.get("counts"), gain_s=record["gain_s"],
                    relayout_s=record["relayout_s"])  # fmt: skip

    def _apply(self, best: dict[str, Any]) -> None:
        changes = relayout_changes(best, self.pipe.schedule.name, self.pipe.num_ranks)
        if self.lead is not None:
            self.lead.tell(RELAYOUT, changes)
        self._relayout(changes)
        self._recalibrate()

    def _relayout(self, changes: dict[str, Any]) -> None:
        start = time.perf_counter()
        self.pipe.relayout(**changes)
        self.relayouts.append(time.perf_counter() - start)
        self.pipe.replanned_cut = list(changes["partition"])  # recorded as re-planned: a resume takes it back

    def _recalibrate(self) -> None:
        """A fresh calibration of the running layout, told the ranks' speeds (:attr:`told`); a held rank's, never
        predicted, is measured on this cut (``caps``)."""
        old = self.calibrator
        self.calibrator = RunCalibrator(self.pipe, self.prior, cores=old.cores, processes=old.processes, warmup=1,
                                        after=old.after, speeds=self.told, bandwidth=old.bandwidth,
                                        caps=self.caps.caps())  # fmt: skip
        self.calibrator.on_event, self.calibrator.affinity = old.on_event, old.affinity
        self._seen = self._makespans = 0
        self._compute = []
