"""An elastic job whose survivors keep their processes: the re-layout across generations of members.

``sw.runtime.InPlace(layout, build, checkpoints=root)`` runs a training loop on workers that meet on the store
``stagewise rendezvous`` hosts (``STAGEWISE_STORE=host:port``; ``stagewise run --in-place`` sets it). When
a machine is lost, every surviving worker stays in its process:

1. its step fails (a failed op on the dead peer, or a wait its heartbeat ends), and it gives up the pipeline of
   that generation: nothing of it is kept but its snapshots, already in the machines' memory;
2. the survivors agree on the next generation and its members on the store (:mod:`..elastic.membership`) and
   meet in a process group of that generation (:mod:`..comm.generations`);
3. the runtime holds the layout policy: ``layout.at(members)`` is the new mesh, ``build(fit)`` makes the pipeline
   for it, and its state comes from the newest *committed* step: the newest snapshot that every rank wrote and
   copied (``snapshot=1``: the last step every stage finished). The survivors re-lay out in place
   (:mod:`.takeover`): a tensor a survivor still holds at that step is kept (aliased) or moved from it, the rest -
   the lost machine's stages, a survivor's tensors past the committed step - come from the snapshot files the
   survivors' machines hold. When that path refuses (a checkpoint on disk is newer, no snapshot covers the state, a
   damaged file) every member resumes from the snapshots and the disk instead (``sw.checkpoint.resume``).
   ``Recovery.sources`` says which path was taken. A step in flight when the machine died is done again at the new
   layout, from the same global batch (``batch(step)``), so no survivor is ever at a mixed step and no committed
   step is rolled back.

A worker that was stopped or cut off and wakes behind the job's generation writes nothing more (no snapshot, no
checkpoint, no message to the new group: fenced by :meth:`..elastic.membership.Membership.fenced`); it exits 3.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from ...parallel import ElasticLayout, Fit
from .. import assembly  # noqa: F401 (loaded with InPlace, before a newcomer asks: the members wait for its build)
from ..checkpoint import state
from ..checkpoint.api import save as checkpoint_save
from ..checkpoint.declared import PipelineState
from ..checkpoint.parts import SavedInParts
from ..checkpoint.resume import resume as checkpoint_resume
from ..comm import release
from ..comm.faults import heartbeat
from ..comm.generations import job_store, join_generation, leave_generation
from ..elastic import joining
from ..elastic import membership as ms
from ..elastic.generation_failed import file_error, in_words
from ..frontends.given import GivenStages
from ..frontends.layers import built_empty
from .let_go import let_go
from .models import BUILT_WHOLE
from .primitive import Held
from .sources import in_place_refusal
from .takeover import LiveRefused, hold, take_over

log = logging.getLogger(__name__)

FENCED_EXIT = 3
MADE_BY_USER = (*BUILT_WHOLE, GivenStages)  # ways in whose model build(fit) makes (and initialises) itself
RESTORE_ENV = "STAGEWISE_INPLACE_RESTORE"  # "snapshots": a recovery resumes from the files only (the path before)
_TRIES = 5  # generations agreed in one recovery at most (each loses a member that died meanwhile)


class InPlaceRefused(ValueError):
    """The pipeline ``build(fit)`` returned cannot be taken over in place (the same reason on every member)."""


@dataclass
class Recovery:
    """One change of membership, as the survivors saw it (what the benchmark and the tests read)."""

    generation: int
    members: list[int]
    failed_at: int  # the step that was running when the generation failed
    committed: int  # the step the survivors went on from
    seconds: float  # from the failure seen here to the new pipeline's state restored
    parts: dict[str, float] = field(default_factory=dict)  # seconds: hold, drop, agree, group, build, resume
    sources: dict[str, Any] = field(default_factory=dict)  # path: live or snapshots; names kept / live / snapshot
    cause: str = "lost"  # or "joined": newcomers taken in after step ``failed_at`` (:mod:`..elastic.joining`)
    evidence: dict[str, Any] = field(default_factory=dict)  # how each member was counted; the ports probed


@dataclass
class InPlace:
    """A training loop whose survivors keep their processes when a machine is lost (see the module doc).

    ``layout``: the policy (``layout.at(world)`` at every generation); ``build(fit)``: the pipeline for a
    fit, with ``snapshot=`` (its snapshots are what a lost stage comes back from); ``checkpoints``: the disk
    checkpoints' folder (resumed from when newer than the snapshots). ``deadline_s``: how long the survivors
    wait for each other when agreeing on a generation. ``silence_s``: a member whose stamps on the store stand
    still this long is lost (its machine stopped or cut off), found while a step runs, not at ``timeout``."""

    layout: ElasticLayout
    build: Callable[[Fit], Any]
    checkpoints: str | os.PathLike[str]
    timeout: float = 20.0
    deadline_s: float = 10.0
    silence_s: float = 3.0  # 6 stamps; a live process stamps from a thread of its own, however slow its steps
    backend: str = "gloo"
    after_recovery: Callable[[InPlace], None] | None = None  # called on every member once its state is back
    recoveries: list[Recovery] = field(default_factory=list)
    pipe: Any = None
    step: int = 0
    _members: ms.Membership | None = None
    _parts: dict[str, float] = field(default_factory=dict)
    _store: Any = None
    _held: Held | None = None  # the failed generation's tensors, kept for the next one's take-over
    _sources: dict[str, Any] = field(default_factory=dict)
    _ports: dict[int, str] = field(default_factory=dict)  # the probes' last results seen in a recovery
    # the members' look for newcomers between steps (:class:`..elastic.joining.Joins`: made and read there)
    joins: Any = field(default=None, init=False, repr=False)
    _placement: dict[str, Any] | None = None  # the last generation's stages' placement (see :func:`_refused`)

    def start(self) -> int:
        """Join the job (generation 0, every process of the launch; or, started with ``STAGEWISE_JOIN=1``, a
        running job at its next step boundary: :mod:`..elastic.joining`) and resume; returns the step resumed."""
        self._store = _job_store(self.timeout)
        silent_s = min(self.timeout, self.silence_s)
        heartbeat.set_lost_silence(silent_s)  # (a copy in flight gives up a peer silent this long, no sooner)
        self._members = ms.stamping_until_exit(joining.membership(self._store, self.deadline_s, silent_s=silent_s))
        self._members.usable = self._fits
        self._members.per_machine = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))  # (ids in blocks of it)
        ms.set_fence(self._members.fenced)
        self._enter(self._members.generation)
        return self.step

    @property
    def live_silence_s(self) -> float:
        """How near a live member came to ``silence_s`` as this worker read it (:mod:`..elastic.silence_margin`)."""
        return self._members.margin.live_s if self._members is not None else 0.0

    @property
    def me(self) -> int:
        """This worker's id in the job (its generation-0 rank, or the one it claimed as a newcomer)."""
        return self._members.me if self._members is not None else int(os.environ.get("RANK", "0"))

    def speaks_for_machine(self, members: Sequence[int] | None = None) -> bool:
        """Whether this worker says the generation's lines on its machine's console (``Membership``'s say)."""
        return self._members is None or self._members.speaks_for_machine(members)

    @property
    def generation(self) -> int:
        return self._members.generation if self._members is not None else 0

    @property
    def members(self) -> list[int]:
        return list(self._members.members) if self._members is not None else []

    @property
    def store(self) -> Any:
        """The job's store, outliving the generations: agreements, rendezvous, newcomers (:mod:`..elastic.joining`)."""
        return self._store

    def take_in(self, step: int) -> tuple[list[int], dict[str, float]]:
        """End this generation after ``step`` (its snapshot committed here and at the next machine) and enter the
        next, whose members the agreement gives (newcomers included); returns them and the seconds of each part
        (what :func:`..elastic.joining.grow` records). Every member of the next generation calls it."""
        self._parts = {}
        with self._timed("commit"):
            self.pipe.snapshots.wait()
        with self._timed("drop"):
            self._drop_pipeline()
        return self._next_generation([]), dict(self._parts)

    def run(self, steps: int, batch: Callable[[int], tuple[Any, Any]]) -> Iterator[tuple[int, float]]:
        """Train to ``steps``: yields ``(step, loss)`` after each step this rank finished; ``batch(step)`` is
        the step's *global* batch (each generation takes its own share). A step is yielded again when a loss
        of membership made the survivors do it again (the losses of a redone step are the new layout's)."""
        if self.pipe is None:
            self.start()
        while self.step < steps:
            step = self.step + 1
            try:
                with self._members.watching(_post_silent) if self._members is not None else nullcontext():
                    loss = self.pipe.train_step(*self.pipe.local_batch(*batch(step)))
            except ms.Fenced:
                self._leave_fenced()
            except Exception as err:  # a lost peer: a failed op, or a wait ended by a failure posted (a silent one)
                self._recover(step, err)
                continue
            self.step = step
            yield step, loss
            joining.between_steps(self, step, step >= steps, Recovery)  # newcomers, taken in between steps

    def save(self) -> None:
        """A checkpoint of the step reached, unless this worker is fenced (then it leaves)."""
        ms.check_fence("a checkpoint")
        checkpoint_save(self.checkpoints, self.pipe, step=self.step)

    def _enter(self, generation: int) -> None:
        assert self._members is not None
        size = len(self._members.members)
        with self._timed("group"):
            join_generation(self._store, generation, self._members.rank, size, self.backend, self.timeout)
        with self._timed("build"):
            self.pipe = self._build(size, empty=generation > 0)
        self._placement = _refused(self.pipe, self._placement)
        with self._timed("resume"):
            restored = self._restore(generation)
        if restored is None and generation > 0:  # nothing to fill an empty build from: the build that initialises
            with self._timed("build"):
                self._drop_pipeline()
                self.pipe = self._build(size, empty=False)
        self.step = restored or 0
        self._held = None  # aliased into the new pipeline, or not needed: let go

    def _build(self, size: int, empty: bool) -> Any:
        """``build(fit)``; ``empty`` (a generation after a change of members, whose state the take-over or the
        resume fills): inside :func:`..frontends.layers.built_empty`, as ``pipe.relayout`` builds, so that a layer
        spec is built on ``meta`` and given storage, never initialised only to be overwritten. A model the build
        makes itself (``from_model``, ``from_hf``, ``from_stages``) is the user's code: initialised there."""
        if not empty:
            return self.build(self.layout.at(size))
        with built_empty():
            pipe = self.build(self.layout.at(size))
        way_in = getattr(pipe, "frontend", None)
        if isinstance(way_in, MADE_BY_USER):
            log.info(
                "stagewise elastic: build(fit) made its %s model itself (initialised there)", type(way_in).__name__
            )
        return pipe

    def _restore(self, generation: int) -> int | None:
        """The new pipeline's state: from the survivors' live tensors and the snapshots they hold (after a loss),
        else (the first generation, or the live path refused alike everywhere) the resume's newest source; None
        when no source holds one (a fresh start)."""
        if generation > 0 and os.environ.get(RESTORE_ENV) == "snapshots":  # the resume only, to compare
            self._sources = {"path": "snapshots", "refused": f"{RESTORE_ENV}=snapshots"}
        elif generation > 0:
            try:
                done = take_over(self.pipe, self._held, Path(self.checkpoints), self.timeout)
                self._sources = {"path": "live", **done.counts, "generation": done.generation}
                return done.step
            except LiveRefused as why:
                log.warning("stagewise elastic: resuming from the snapshots: the live path refused (%s)", why)
                self._sources = {"path": "snapshots", "refused": str(why)}
        info = checkpoint_resume(Path(self.checkpoints), self.pipe, timeout=self.timeout)
        return None if info is None else info.step

    @contextmanager
    def _timed(self, part: str) -> Iterator[None]:
        started = time.perf_counter()
        yield
        self._parts[part] = self._parts.get(part, 0.0) + time.perf_counter() - started

    def _recover(self, step: int, err: BaseException) -> None:
        assert self._members is not None
        started = time.perf_counter()
        at, where = (self._members.generation, step), file_error(err, self._members.generation)  # gloo's text
        self._parts, self._sources = {}, {}
        heartbeat.post_failure(str(err))  # every pipeline of the generation stops now, not at its timeout
        with self._timed("hold"):
            self._held = hold(self.pipe)  # its tensors only: the groups and threads go with the pipeline
        with self._timed("drop"):
            self._drop_pipeline(err)
        # the dead the failure named, and any other whose port refuses by now (a machine's processes die one
        # after another: the failure may name only the first; a snapshot's copy cut off names none): the line
        # names them all
        gone = ms.named_dead(f"{err} {heartbeat.blame_gone()}", self._members.members)
        nproc = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
        line = in_words(str(err), type(err).__name__, at, self._members.members, nproc, where, gone)
        self._say(self._members.speaks_for_machine(without=gone), "stagewise elastic: %s", line)
        self._ports = heartbeat.probe_report()  # (the next generation's heartbeat starts afresh)
        members = self._next_generation(gone)
        self.recoveries.append(
            Recovery(self._members.generation, members, step, self.step, time.perf_counter() - started, self._parts)
        )
        self.recoveries[-1].sources = self._sources
        self.recoveries[-1].evidence = {"named": gone, **self._evidence()}
        self._say(
            self._members.speaks_for_machine(members),
            "stagewise elastic: generation %d: workers %s (%d processes) go on from step %d, in %.1f s (%s)",
            self._members.generation,
            members,
            len(members),
            self.step,
            time.perf_counter() - started,
            ", ".join(f"{k} {v}" for k, v in self._sources.items() if k != "refused"),
        )
        if self.after_recovery is not None:
            self.after_recovery(self)

    @staticmethod
    def _say(speaks: bool, text: str, *args: Any) -> None:
        """A line of the machine's console (a warning) from the worker that speaks for it; the log's alone (info)
        from the others."""
        (log.warning if speaks else log.info)(text, *args)

    def _next_generation(self, gone: list[int]) -> list[int]:
        """Agree on the next generation and enter it; a member lost meanwhile (the group's handshake or the
        resume fails) costs one more generation without it, :data:`_TRIES` at most. ``gone``: the members the
        failure named dead (not waited for)."""
        assert self._members is not None
        for attempt in range(_TRIES):
            try:
                with self._timed("agree"):
                    members = self._members.next(self.deadline_s, gone, self._gone_now)
                self._enter(self._members.generation)
                return members
            except ms.Fenced:
                self._leave_fenced()
            except InPlaceRefused:  # (alike on every member: no other generation would do better)
                raise
            except Exception as err:  # a member lost during the recovery
                if attempt == _TRIES - 1:
                    raise
                log.warning(
                    "stagewise elastic: generation %d failed while it was being made (%s); agreeing again",
                    self._members.generation,
                    str(err).splitlines()[0][:300] if str(err) else type(err).__name__,
                )
                self._drop_pipeline()
        raise AssertionError("unreachable")

    def _fits(self, size: int) -> bool:
        """Whether the layout can run at ``size`` processes (a proposal takes in only newcomers that fit)."""
        try:
            self.layout.at(size)
        except ValueError:
            return False
        return True

    def _evidence(self) -> dict[str, Any]:
        """How the last agreement counted each member, and what this worker's probes of the ports got."""
        decided = self._members.decided if self._members is not None else {}
        return {"decided": {str(k): v for k, v in decided.items()}, "ports": self._ports}

    def _gone_now(self) -> list[int]:
        """The members whose process is gone by now (their liveness port refuses: never a live one)."""
        assert self._members is not None
        gone = ms.named_dead(heartbeat.blame_gone(), self._members.members)
        self._ports = heartbeat.probe_report()
        return gone

    def _drop_pipeline(self, err: BaseException | None = None) -> None:
        """The failed generation's pipeline goes; its snapshots stay on the machines (they are the state).

        Its helper threads stop now; its gloo groups are dropped, not destroyed here (a destructor may join a
        thread stuck on a stopped peer until the timeout): :func:`..comm.release.hold` keeps the groups and their
        stores - nothing else - until the group timeout has passed. Its tensors go at once (:func:`.let_go.let_go`;
        ``err``: the failure, whose traceback holds the failed step's locals), but those :func:`.takeover.hold`
        kept for the take-over, which the new layout aliases."""
        snaps = self.pipe.snapshots if isinstance(self.pipe, PipelineState) else None
        if snaps is not None:
            with self._timed("drop:snapshots"):
                snaps.finish_at_exit(quiet=err is not None)  # the copy in flight ends (written, or failed on
                # the dead peer: said in the log alone, the failure's line says what happened): whole files
                snaps.forget()
        transport = getattr(self.pipe, "transport", None)
        if transport is not None:
            with self._timed("drop:threads"):
                transport.close()  # the guard's helper threads (a failure stands: its groups are kept)
        release.hold(release.groups_now(), self.timeout + 1.0)
        let_go(self.pipe, err)
        self.pipe = None

    def _leave_fenced(self) -> NoReturn:
        self._drop_pipeline()
        if self._members is not None:
            self._members.stop()
        leave_generation()
        log.error("stagewise elastic: %s", ms.last_fence())
        raise SystemExit(FENCED_EXIT)


def _post_silent(ranks: list[tuple[int, float]]) -> None:
    """A member silent while a step runs (:meth:`..elastic.membership.Membership.watching`): the generation's failure,
    in the heartbeat's words (``global rank 2 stopped or died``), so every wait of the step ends now rather than at
    the hang threshold, and the agreement does not wait for it."""
    named = heartbeat.blame(ranks).removesuffix(")")  # the details inside the parentheses: the line reads them
    heartbeat.post_failure(f"{named} on the job's store: its machine stopped or was cut off)")


def _refused(pipe: Any, before: dict[str, Any] | None) -> dict[str, Any]:
    """The new pipeline's placement, or :class:`InPlaceRefused` (:func:`.sources.in_place_refusal`)."""
    given = isinstance(getattr(pipe, "frontend", None), GivenStages)
    parts = isinstance(pipe, SavedInParts)  # a HetPipe declares its VW's state, but saves in parts: refused
    kind = "given" if given else "pipeline" if isinstance(pipe, PipelineState) and not parts else type(pipe).__name__
    now = None
    if kind in ("pipeline", "given"):
        laid = state.layout_of(pipe, 0)["pipeline"]
        now = {k: laid[k] for k in ("ranks", "placement", "virtual_stages")}
    why = in_place_refusal(kind, before, now)
    if why is not None:
        raise InPlaceRefused(why)
    return now or {}


def _job_store(timeout: float) -> Any:
    """This job's prefix of the store that outlives the machines (``STAGEWISE_STORE``, the job's name from
    ``TORCHELASTIC_RUN_ID``)."""
    where = os.environ.get(ms.STORE_ENV)
    if not where or ":" not in where:
        raise ValueError(
            f"an in-place elastic job needs {ms.STORE_ENV}=host:port, the store `stagewise rendezvous` hosts "
            f"(stagewise run --in-place sets it from --rdzv-endpoint); got {where!r}"
        )
    return job_store(where, os.environ.get("TORCHELASTIC_RUN_ID") or "stagewise", timeout)
