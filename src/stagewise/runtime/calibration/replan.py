"""Re-planned live (issue 49 items 3 and 4): the run's calibration asks whether another plan pays, and applies it.

``Replanner(pipe, steps=N)`` is called on every rank after each ``train_step`` (``observe()``, a collective). It
feeds a :class:`~stagewise.runtime.calibration.from_run.RunCalibrator`; when that calibrates, names a straggler or
clears one, and every ``every`` steps besides, the group's first rank builds the candidates (for each schedule
considered, the cut for the ranks' measured speeds, with the step the calibrated model predicts) and asks the pure
decision (:func:`stagewise.planning.replan.decide`: change only when the gain over the steps left exceeds the
re-layout's cost plus a margin, :func:`~stagewise.planning.replan.noise_margin`, drawn from the calibration's own
uncertainty, the measured speeds' standard error and the step-to-step spread of the last :data:`SPREAD_STEPS`
steps; never within ``cooldown`` steps of the last change). Its record is handed to every rank (one decides, so
every rank applies the same change), logged in one line, recorded as the ``replan`` event of ``pipe.metrics`` and
appended to ``log`` (and to ``log_path``, JSON lines, on the first rank). A change is applied with
:meth:`Pipeline.relayout`; its measured seconds are the next decision's cost (not a first re-layout's one-off
costs: :func:`~stagewise.planning.replan.relayout_cost`), and a new calibration starts on the
new layout (the old one described another cut), told the ranks' speeds inside their compute actions at the decision
(:func:`~stagewise.planning.stragglers.compute_speeds`: what its measured actions must be divided by to give the
layers' own costs; a rank held by a cap is not told but measured on the new cut,
:func:`~stagewise.planning.capped.held_speed`), so that a straggler stays a slow rank rather than becoming costly
layers: when its throttle lifts it is "recovered" and the cut for equal speeds moves its layers back. A CPU quota is a
cap, not a speed: a held rank the re-cut left little work stays under its cap and its steps cannot show the lift, so
every ``probe_every`` steps while a rank is held slow every rank is probed with a short busy loop (:mod:`.probe`); a
held one whose share of a core is back above :data:`~stagewise.planning.stragglers.RECOVERED` of the largest is
taken at full speed and a fresh
calibration starts, whose news re-decides (the cut for equal speeds: moved back when it pays). The probe also
gives a held rank's cap (:class:`~stagewise.planning.stragglers.Caps`; probed at once when a rank is named), and
the candidates, the running cut among them, are priced with its compute capped
(:func:`~stagewise.planning.capped.priced`) rather than at its measured speed: a rank left under its cap reads
fast, and a constant speed mis-prices every other cut. A cap that moves past its noise re-decides at once.
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

from ...ir import Schedule
from ...partition import LayerProfile
from ...passes.build import build_schedule
from ...planning.recalibrate import Z85, RunCalibration
from ...planning.replan import (
    Decisions,
    Option,
    cap_error,
    line,
    options_for,
    relayout_cost,
    relayout_seconds,
    step_spread,
)
from ...planning.stragglers import (
    LEAST_ERROR,
    NOISE_STEPS,
    RECENT,
    SLOW,
    WINDOW,
    compute_speeds,
    rank_speeds,
    ratio_error,
    speed_error,
)
from ..comm.groups import group_rank
from ..frontends.balance import on_first_rank
from .from_run import RunCalibrator
from .held import HeldProbes
from .probe import pipeline_probes

log = logging.getLogger(__name__)

#: a re-layout's seconds beyond moving the state, before one was measured: new groups and the stages rebuilt
#: (the replan_live check's 2-process re-layouts of 8 tiny layers took 0.04-0.06 s at load 8; a real model
#: rebuilds more: 1 s is a cautious start, replaced by the measured seconds after the first re-layout)
REBUILD_S = 1.0
#: the state moved per parameter byte, before a re-layout was measured: the weights and Adam's two moments
STATE_PER_PARAMETER_BYTE = 3.0
#: the steps whose step-to-step spread draws the margin (the last ones, across changes of plan: a change is
#: one outlying difference, which the median ignores)
SPREAD_STEPS = 20


class Replanner:
    """Re-plans ``pipe`` live from its own run (module docstring); ``steps``: the job's total train steps.

    ``schedules``: other schedule names to consider at the same ranks and micro-batches (default: the running one
    only, so only the cut moves); ``relayout_s``: the re-layout's cost until one is measured (default: the state's
    bytes over the calibrated link plus :data:`REBUILD_S`; then :func:`~stagewise.planning.replan.relayout_cost`:
    the last measured, a first one's one-off costs left out); ``every``: steps between decisions besides the
    calibration's news (0: on news only; a slowdown first measured on a window not yet full of slow steps is looked
    at again once it is); the margin a gain must clear beside it is ``z`` x the steps' step-to-step spread x the
    running step x the steps left, plus ``margin_s`` (a fixed part, 0 by default); ``guard_calibration``: the margin
    also holds the calibration's own uncertainty (its stages' spread over its few steps,
    :attr:`~stagewise.planning.recalibrate.RunCalibration.uncertainty`), so that a fresh calibration after a change,
    noisier than the steps' spread says, does not re-cut on its noise; ``probe_every``: steps between probes of
    the ranks held slow (0: never; a cap a rank no longer meets shows only there), ``probe``: what gives every
    rank's probed share of a core (a collective; default :func:`.probe.probe_shares`); ``quota_probe``: every
    rank's CPU quota as a share of a core, None where unknown (a collective; default :func:`.probe.quota_shares`,
    none where ``probe`` is given). While every held rank's cap is its quota, the quotas are read every step and
    the loop probes only when one moves (:class:`.held.HeldProbes`).
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
    ) -> None:
        if steps < 0 or every < 0 or probe_every < 0:
            raise ValueError(
                f"Replanner: steps, every and probe_every must be >= 0, got {steps}, {every}, {probe_every}"
            )
        self.pipe = pipe
        self.calibrator = calibrator or RunCalibrator(pipe)
        self.prior: LayerProfile = self.calibrator.prior
        self.steps = int(steps)
        self.schedules = tuple(schedules)
        for name in self.schedules:  # a schedule that cannot run here fails now, on every rank, not mid-run
            _like(name, pipe.schedule, "Replanner: schedules= names ")
        self.relayout_s = relayout_s
        #: the seconds of each re-layout this Replanner applied, in order
        self.relayouts: list[float] = []
        self.log_path = None if log_path is None else Path(log_path)
        self.decisions = Decisions(margin_s=margin_s, cooldown=cooldown, z=z)
        self._seen = 0
        self._makespans = 0
        self.every = int(every)
        self.guard_calibration = bool(guard_calibration)
        self._since_decision = 0
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
        self.held = HeldProbes(pipe.num_ranks, int(probe_every), loop, quota_probe or quota)
        self.caps, self.probes = self.held.caps, self.held.log  # (the same objects: the held ranks' caps, probes)
        self._priced = [1.0] * pipe.num_ranks  # the caps as the last decision priced them

    @property
    def log(self) -> list[dict[str, Any]]:
        """Every decision so far, taken or not (plain dicts; :func:`stagewise.planning.replan.replay`)."""
        return self.decisions.log

    def observe(self, timeline: Any = None) -> dict[str, Any] | None:
        """After a train step, on every rank alike: calibrate, and re-plan when the calibration has news; the
        decision's record (None when nothing was decided). ``timeline``: the step's, every rank on one clock
        (default: gathered from the pipeline, a collective)."""
        if timeline is None:
            timeline = self.pipe.timeline(gather=True)
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
        named = [int(r["rank"]) for r in news if r["event"] == "straggler named"]
        if self.held.every and [r for r in named if r not in self._held()]:  # its cap before the first decision
            self._probe(now=named)
            if self.calibrator is not cal:  # that probe freed another rank: a fresh calibration decides
                return None
        self._since_decision += 1
        due = self.every > 0 and self._since_decision >= self.every
        if cal.calibration is None or not (news or due or self.caps.moved()):
            return None
        if self.held.since and self._held():  # the caps as of this step: a quota deepened since the last probe
            self._probe(now=self._held())  # priced at its old cap moved work onto the held rank (2026-12-03 04:17)
            if self.calibrator is not cal:  # the probe freed a rank: a fresh calibration (a new calibrator) decides
                return None
        self._since_decision = 0
        self._priced = self.caps.priced_now()  # on every rank alike: moved() is asked on every rank
        decided: dict[str, Any] = on_first_rank(None, self._decide, "deciding whether to re-plan")
        record, self.speeds = decided["record"], decided["speeds"]
        self.speed_errors, self.told = decided["errors"], decided["told"]
        self.decisions.log.append(record)
        if record["taken"]:
            self.decisions.last_change = record["step"]
        self._tell(record)
        if record["taken"]:
            self._apply(record["best"])
        return record

    def _watch(self, timeline: Any, cal: RunCalibration) -> None:
        """This step's speeds inside the compute actions (what a calibration after a change is told) and from
        when each action could start (their noise: the decision's speed error), relative to the fastest rank."""
        n = self.pipe.num_ranks
        inside, spans = compute_speeds(timeline, cal, n), rank_speeds(timeline, cal, n)
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
        # are the probe's, and the error is the floor (:meth:`_errors`): the fresh calibration's spread over the
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
        self.pipe.metrics.event("straggler lifted", step=int(self.pipe.train_steps), ranks=free)
        self._recalibrate()

    def _named_by_probe(self, ranks: list[int], shares: list[float]) -> None:
        """One line and an event for ranks a probe found capped before their steps named them."""
        if group_rank(None) == 0:
            said = f"probed at {[round(s, 2) for s in shares]} of a free rank's share of a core twice running"
            log.warning(
                "stagewise: rank(s) %s %s: held by a quota; the next decision prices them by that cap", ranks, said
            )
        self.pipe.metrics.event("straggler named", step=int(self.pipe.train_steps), ranks=ranks, by="probe")

    def _decide(self) -> dict[str, Any]:
        """On the first rank: the candidates and the pure decision (not yet logged: every rank logs the same)."""
        cal = self.calibrator
        assert cal.calibration is not None
        step = int(self.pipe.train_steps)
        full = [len(h) == WINDOW for h in cal.detector.history]  # measured where a window is full, else what
        measured = cal.detector.speeds()  # was known when this calibration began
        speeds = [measured[r] if f else self.speeds[r] for r, f in enumerate(full)]
        errs = self._errors(full)
        told = self.told
        if len(self._compute) == RECENT:  # the same recent steps as the speeds the decision takes
            told = [statistics.median(c[r] for c in self._compute) for r in range(len(told))]
        current, candidates = self._options(cal.calibration, speeds, self._priced)
        capped = [c < 1 for c in self._priced]  # priced by their caps: their measured speeds' noise is not used
        error = ratio_error([0.0 if c else e for e, c in zip(errs, capped)])
        if any(capped):
            plans = [self.pipe.schedule] + [_like(n, self.pipe.schedule) for n in self.schedules]
            held = cap_error(
                cal.calibration, self.prior, plans, current, candidates, speeds, self._priced, self.caps.error()
            )
            error = math.hypot(error, held)
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
        return {"record": record, "speeds": speeds, "errors": errs, "told": told}

    def _errors(self, full: list[bool]) -> list[float]:
        """Each rank's speed error: from its measured speeds where its window is full, else the last decision's;
        since a lift (NaN, :meth:`_probe`) and until 3 free speeds, :data:`LEAST_ERROR`."""
        out = []
        for r, f in enumerate(full):
            since_lift = math.isnan(self.speed_errors[r])
            if f and not (since_lift and len(self.series[r]) < 3):
                out.append(speed_error(self.series[r]))
            else:
                out.append(LEAST_ERROR if since_lift else self.speed_errors[r])
        return out

    def _options(self, cal: RunCalibration, speeds: list[float], caps: list[float]) -> tuple[Option, list[Option]]:
        running = self.pipe.schedule
        others = [_like(n, running) for n in self.schedules if n != running.name]
        counts = [len(r) for r in self.pipe.layer_ranges]
        return options_for(cal, self.prior, running, counts, speeds, others, caps)

    def _cost(self, cal: RunCalibration) -> float:
        predicted = self.relayout_s
        if predicted is None:
            own = sum(p.numel() * p.element_size() for p in self.pipe.parameters())
            state = own * self.pipe.num_ranks * STATE_PER_PARAMETER_BYTE
            predicted = relayout_seconds(state, cal.bandwidth, REBUILD_S) if cal.bandwidth > 0 else REBUILD_S
        return relayout_cost(self.relayouts, predicted)

    def _tell(self, record: dict[str, Any]) -> None:
        first = group_rank(None) == 0
        if first:
            (log.warning if record["taken"] else log.info)("%s", line(record))
            if self.log_path is not None:
                with self.log_path.open("a") as f:
                    f.write(json.dumps(record) + "\n")
        best = record["best"] or {}
        self.pipe.metrics.event(
            "replan",
            step=record["step"],
            taken=record["taken"],
            reason=record["reason"],
            schedule=best.get("schedule"),
            counts=best.get("counts"),
            gain_s=record["gain_s"],
            relayout_s=record["relayout_s"],
        )

    def _apply(self, best: dict[str, Any]) -> None:
        changes: dict[str, Any] = {"partition": list(best["counts"])}
        if best["schedule"] != self.pipe.schedule.name:
            changes["schedule"] = best["schedule"]
            per_rank = len(best["counts"]) // self.pipe.num_ranks
            if per_rank > 1:
                changes["virtual_stages"] = per_rank
        start = time.perf_counter()
        self.pipe.relayout(**changes)
        self.relayouts.append(time.perf_counter() - start)
        self.pipe.replanned_cut = list(best["counts"])  # recorded as re-planned: a resume takes it back
        self._recalibrate()

    def _recalibrate(self) -> None:
        """A fresh calibration of the running layout, told the ranks' speeds (:attr:`told`)."""
        old = self.calibrator
        self.calibrator = RunCalibrator(
            self.pipe,
            self.prior,
            cores=old.cores,
            processes=old.processes,
            warmup=1,
            after=old.after,
            speeds=self.told,
            caps=self.caps.caps(),  # a held rank's speed measured on this cut (from_run), never predicted
            bandwidth=old.bandwidth,
        )
        self.calibrator.on_event = old.on_event
        self._seen = self._makespans = 0
        self._compute = []


def _like(name: str, running: Schedule, refused: str = "") -> Schedule:
    """Schedule ``name`` at the running one's ranks and micro-batches; ``refused``: what a schedule that cannot run
    there is refused with (its name, the ranks and micro-batches and why follow)."""
    try:
        return build_schedule(name, len(running.ranks), running.num_microbatches)
    except (KeyError, ValueError) as err:
        if not refused:
            raise
        raise ValueError(
            f"{refused}{name!r}, which cannot run at {len(running.ranks)} ranks and {running.num_microbatches} "
            f"micro-batches: {err}"
        ) from err
