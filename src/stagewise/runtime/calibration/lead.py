"""One rank watches the run for all (issue 49 item 4: what watching a run costs).

The :class:`~stagewise.runtime.Replanner`'s watch (every rank's events decoded into one timeline, the calibration,
the ranks' speeds, the probes' bookkeeping, the decisions) was run by every rank alike, so that each knew which
collective came next. Every rank paid for it, and a rank held by a quota paid four times over at a quarter of a
core: ``benchmarks.watch_cost`` measured the watch at +7.5 ms a step free and +21 ms (18 % of the step) with
rank 1 at a quarter of a core (2026-12-04 10:34).

With a lead, the group's first rank (rank 0 of the default group, the rank that logs) watches. Every other rank,
each step: sends its step's events to it (:meth:`Lead.step_in`; with its cgroup quota while the lead reads a held
rank's quota every step), one way (:func:`~stagewise.runtime.comm.collectives.gather_to_first`: a rank held by a
quota answers an all-gather a period late, and the lead's words go down as broadcasts), then serves what the lead's
watch asks of every rank (:meth:`Lead.serve`): a loop probe of every rank's share of a core, the quotas, the CPU
affinity a calibration reads, a re-layout; until the lead's last word for the step, which carries what every rank
keeps (the decision's record, the calibration's events, the events for ``pipe.metrics``, the speeds). A failure of
the watch on the lead is said to the others, who raise it rather than wait. Every word crosses as JSON (nothing a
peer sends is unpickled), within the pipeline guard's deadline and error board.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any, NamedTuple

from ...ir import Timeline
from ..comm import collectives
from ..comm.groups import group_rank, group_size, initialized
from ..engine.reports import merged_timeline, step_meta, wall_rows
from ..errors import PipelineError
from ..measure.cores import node_affinity
from .probe import pipeline_wait, quota_share
from .replicas import replica_degree


class Sides(NamedTuple):
    """The Replanner's own parts its lead calls (handed in, never reached for): this rank's side of the loop probe,
    of the quotas' gather and of a re-layout; the watch of a step on the lead; the next step watched."""

    loop: Callable[[], Any]
    quota: Callable[[], Any]
    relayout: Callable[[Any], None]
    observe: Callable[[Any, int], dict[str, Any] | None]
    pace: Callable[[int, dict[str, Any] | None], int]


#: the words the lead says to the others: join a loop probe, the quotas' gather, the affinity's gather; re-lay
#: out; the step is done (with what to keep); the watch failed (with why)
LOOP, QUOTA, AFFINITY, RELAYOUT, DONE, FAILED = "loop", "quota", "affinity", "relayout", "done", "failed"


def can_lead(pipe: Any) -> str:
    """Why ``pipe``'s watch cannot have a lead ("" when it can): the default group must be the pipeline's ranks
    and nothing else (a Replanner refuses replicas before asking: :func:`refuse_replicas`)."""
    if not initialized() or group_size(None) == 1:
        return "no process group of more than one rank"
    if group_size(None) != pipe.num_ranks or replica_degree(pipe) > 1:
        return f"the job's {group_size(None)} ranks are not the pipeline's {pipe.num_ranks}"
    return ""


def refuse_replicas(pipe: Any) -> None:
    """A Replanner watches a pipeline that is the whole job. Where the job is larger (replicas, ``parallel=`` with
    dp > 1, or pipelines on groups of their own) each pipeline reads its own steps, so one replica's news, probes and
    decisions (collectives of the whole job) would wait on replicas that saw none: a hang until the guard's
    timeout. Refused on every rank alike, before any step, with what works there instead."""
    if initialized() and group_size(None) > pipe.num_ranks:
        raise ValueError(
            f"Replanner: the job has {group_size(None)} processes and the pipeline {pipe.num_ranks} ranks: with "
            "replicas (or pipelines on groups of their own) each pipeline reads its own steps, and a decision on one "
            "replica's news would wait for replicas that saw none. A Replanner needs the pipeline to be the whole "
            "job; with replicas, RunCalibrator(pipe) calibrates and names a slow rank, and a new plan is applied "
            "from a checkpoint"
        )


def lead_for(pipe: Any, calibrator: Any, leader: bool | None, each_step: bool) -> Lead | None:
    """The lead of a :class:`~stagewise.runtime.Replanner`'s watch of ``pipe`` (None: every rank watches alike):
    ``leader`` True demands one, False refuses one, None takes one where :func:`can_lead`. On the lead rank,
    ``calibrator``'s affinity gather is said to the others first, and its records are kept for them (``each_step``:
    the quota may travel with the events, :class:`Lead`)."""
    why = "" if leader is False else can_lead(pipe)
    if leader and why:
        raise ValueError(f"Replanner: leader=True needs the pipeline's ranks to be the whole job: {why}")
    if leader is False or why:
        return None
    lead = Lead(pipe, quota_each_step=each_step)
    if lead.leads:
        told = calibrator.on_event

        def on_event(record: dict[str, Any]) -> None:
            lead.records.append(record)
            if told is not None:
                told(record)

        calibrator.affinity, calibrator.on_event = lead.driven(AFFINITY, calibrator.affinity), on_event
    return lead


class Lead:
    """Both sides of a lead's watch of ``pipe`` (module docstring); ``quota_each_step``: whether the others may
    send their quota with their events (the default quota probe: :func:`.probe.quota_share`)."""

    def __init__(self, pipe: Any, quota_each_step: bool = True) -> None:
        self.pipe = pipe
        self.leads = group_rank(None) == 0
        self.quota_each_step = quota_each_step
        #: whether every rank sends its quota with the next step's events (the lead's word, while it reads one)
        self.ask_quota = False
        #: this step's quotas, sent with the events (None when not asked)
        self.quotas: list[float | None] | None = None
        #: on the lead: this step's events for ``pipe.metrics`` and the calibration's records, for the others
        self.events: list[list[Any]] = []
        self.records: list[dict[str, Any]] = []

    def step_in(self, timeline: Timeline | None) -> Timeline | None:
        """On every rank after a train step: its events to the lead (none when ``timeline``, every rank's, is given:
        then on every rank) and its quota when asked, one way; the lead gets ``timeline`` or every rank's events
        on one clock, the others None."""
        pipe = self.pipe
        mine = None
        if timeline is None:
            events, _ = pipe.metrics.last_run("train")
            mine = [pipe.rank, wall_rows(events or [], pipe.clock_offset), events is not None]
        quota = quota_share() if self.ask_quota else None
        blob = collectives.encode([mine, quota])
        got = collectives.gather_to_first(blob, None, self._wait(), "every rank's step for the watch")
        if got is None:
            return None
        everyone = [collectives.decode(b) for b in got]
        self.quotas = [q for _, q in everyone] if self.ask_quota else None
        if timeline is not None:
            return timeline
        rows = [m[:2] for m, _ in everyone]
        meta = step_meta("train", everyone[0][0][2], pipe.schedule.num_microbatches)
        return merged_timeline(rows, num_ranks=pipe.num_ranks, name=pipe.schedule.name, meta=meta)

    def tell(self, word: str, body: Any = None) -> None:
        """On the lead: what every other rank does next (:meth:`serve`)."""
        blob = collectives.encode([word, body])
        collectives.from_first(blob, None, self._wait(), f"the watch's word to the others ({word})")

    def driven(self, word: str, fn: Callable[[], Any]) -> Callable[[], Any]:
        """On the lead: ``fn`` (a collective of every rank) with the others told to join it first."""

        def run() -> Any:
            self.tell(word)
            return fn()

        return run

    def quota(self, fn: Callable[[], list[float | None]]) -> Callable[[], list[float | None]]:
        """On the lead: every rank's quota, as sent with this step's events when they were, else ``fn`` driven."""
        driven = self.driven(QUOTA, fn)
        return lambda: self.quotas if self.quotas is not None else driven()

    def done(self, body: dict[str, Any]) -> None:
        """On the lead: the step's last word, ``body`` with this step's events and records; they are cleared."""
        body = {**body, "events": self.events, "records": self.records}
        self.events, self.records = [], []
        self.ask_quota = bool(body.get("quota")) and self.quota_each_step
        self.tell(DONE, body)

    def failed(self, err: BaseException) -> None:
        """On the lead: the watch failed; the others are told why (a tell that cannot reach them is let go: the
        error raised is the lead's own)."""
        with contextlib.suppress(Exception):
            self.tell(FAILED, f"{type(err).__name__}: {err}")

    def serve(
        self, loop: Callable[[], Any], quota: Callable[[], Any], relayout: Callable[[Any], None]
    ) -> dict[str, Any]:
        """On the others: do what the lead says until its last word for the step, which is returned (``loop``,
        ``quota``: this rank's side of the probes; ``relayout``: this rank's re-layout to the changes said)."""
        while True:
            said = collectives.from_first(None, None, self._wait(), "the watch's word from rank 0")
            word, body = collectives.decode(said)
            if word == DONE:
                self.ask_quota = bool(body.get("quota")) and self.quota_each_step
                return body
            if word == FAILED:
                raise PipelineError(f"rank 0 failed while watching the run for every rank: {body}")
            if word == LOOP:
                loop()
            elif word == QUOTA:
                quota()
            elif word == AFFINITY:
                node_affinity(self._wait())
            elif word == RELAYOUT:
                relayout(body)
            else:
                raise PipelineError(f"rank 0's watch said {word!r}, which this rank does not know")

    def watch(self, replanner: Any, timeline: Timeline | None, step: int, sides: Sides) -> dict[str, Any] | None:
        """A watched ``step`` of ``replanner`` (a :class:`~stagewise.runtime.Replanner` this lead serves), on
        every rank: the lead observes and says what the others keep, with the next step watched; the others send,
        serve and keep it. ``sides``: the replanner's own parts the lead calls. The decision's record (None when
        nothing was decided)."""
        merged = self.step_in(timeline)
        if not self.leads:
            return self._follow(replanner, self.serve(sides.loop, sides.quota, sides.relayout))
        n = len(replanner.held.log)
        try:
            record = sides.observe(merged, step)
        except BaseException as err:
            self.failed(err)
            raise
        errors = [None if math.isnan(e) else e for e in replanner.speed_errors]  # NaN: since a lift
        self.done({"record": record, "speeds": replanner.speeds, "errors": errors, "told": replanner.told,
                   "probes": replanner.held.log[n:], "quota": bool(replanner.held.by_quota),
                   "next": sides.pace(step, record)})  # fmt: skip
        return record

    def _follow(self, replanner: Any, done: dict[str, Any]) -> dict[str, Any] | None:
        """On the others: what the lead's last word for the step says every rank keeps (the step's events for
        ``pipe.metrics``, the calibration's records, the speeds, the probes, the decision, the next step watched)."""
        for name, fields in done["events"]:
            self.pipe.metrics.event(name, **fields)
        for emitted in done["records"]:
            replanner.calibrator.emit(emitted)
        replanner.speeds, replanner.told = done["speeds"], done["told"]
        replanner.speed_errors = [math.nan if e is None else e for e in done["errors"]]
        replanner.held.log.extend(done["probes"])
        replanner.cadence.next = done["next"]
        record = done["record"]
        if record is not None:
            replanner.decisions.keep(record)
        return record

    def _wait(self) -> collectives.Wait | None:
        return pipeline_wait(self.pipe)
