"""Who is in the job, generation by generation, kept by the workers on a store that outlives the machines.

``stagewise rendezvous`` hosts a TCPStore on a machine that runs no workers; every worker of an in-place
elastic job is a client of it (``STAGEWISE_STORE=host:port``). Membership is kept there with the c10d
store's own primitives only - ``set``, ``compare_set``, ``check``, ``wait`` (no home-made consensus):

* ``generation``: the current generation's number; each worker knows its own and reads this one before it
  writes anything a later generation could read (:meth:`Membership.fenced`): a worker that was stopped or
  cut off and wakes behind the store leaves (:class:`Fenced`);
* ``alive/<id>``: each worker's stamp (its wall-clock time), every :data:`STAMP_S` (a helper thread): a member
  whose stamp is older than the hang threshold is counted gone without waiting out the whole deadline, once
  it has been seen here standing still for :data:`_CONFIRM_S` (the stamping thread reads the others' stamps
  too: a machine cut off a threshold before the agreement is counted at once);
* ``gen<g>/arrived/<id>``: a survivor of generation g-1 asking for generation g; once every member of g-1
  arrived or went silent (or the deadline passed), the first to propose ``gen<g>/members`` wins
  (``compare_set`` on an empty key), the others read the winner's list; a proposal takes in the newcomers that
  asked for g (``gen<g>/joiners``, :mod:`.joining`);
* ``gen<g>/ready/<id>``: the barrier after the members are decided, with a deadline: a member missing at the
  deadline died during the recovery, and generation g+1 is agreed without it.

A member's id is its global rank at generation 0, or claimed above them by a newcomer (ids never change and
are never given twice; ranks are positions in ``members``, kept in id order).
"""

from __future__ import annotations

import atexit
import json
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from ..comm.blocking import inside
from .silence_margin import SilenceMargin

log = logging.getLogger(__name__)

STORE_ENV = "STAGEWISE_STORE"  # host:port of the store that outlives the machines (stagewise rendezvous)
STAMP_S = 0.5  # how often a worker stamps alive/<id>
_POLL_S = 0.05
_EVIDENCE_S = 0.25  # how often a wait for the others asks ``still_gone`` again
_CONFIRM_S = 2.5 * STAMP_S  # a stamp standing still this long here lets its own age count (see Membership._silent)


_fence: Callable[[str], None] | None = None
_last: list[str] = []


def set_fence(check: Callable[[str], None] | None) -> None:
    """What :func:`check_fence` asks before a write (an in-place job's :meth:`Membership.fenced`)."""
    global _fence
    _fence = check


def check_fence(what: str) -> None:
    """Raise :class:`Fenced` when this worker is behind its job's generation (no-op outside in-place jobs)."""
    if _fence is not None:
        try:
            _fence(what)
        except Fenced as err:
            _last.append(str(err))
            raise


def last_fence() -> str:
    """The reason this worker was last fenced ("" if never)."""
    return _last[-1] if _last else ""


class Fenced(RuntimeError):
    """This worker is behind the job's generation (it was stopped or cut off while the others went on): it
    must not write a snapshot, a checkpoint or a message, and leaves."""


@dataclass
class Membership:
    """This worker's view of the job's membership on ``store`` (a client of the store that outlives the
    machines, already prefixed for the job). ``me``: this worker's id; ``members``: generation 0's ids."""

    store: Any
    me: int
    members: list[int]
    silent_s: float = 20.0  # a member whose stamp did not move for this long is gone (an in-place job: its
    # hang threshold; a live member that is only slow - stopped, starved - for less must never be left out)
    generation: int = 0
    usable: Callable[[int], bool] | None = None  # sizes the job can run at (its layout's); None: any
    per_machine: int = 0  # workers per machine (ids come in blocks of it: id // per_machine); 0: unknown
    decided: dict[int, str] = field(default_factory=dict)  # the last agreement: how each member was counted
    clock: Callable[[], float] = time.monotonic  # this worker's own clock (a test's fake one)
    wall: Callable[[], float] = time.time  # the stamps' clock
    sleep: Callable[[float], None] = time.sleep
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _seen: dict[int, tuple[bytes | None, float]] = field(default_factory=dict)  # stamp, here since (own clock)
    _looked: float = -1.0  # when the stamping thread last read the others' stamps (own clock)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    on_silent: Callable[[list[tuple[int, float]]], None] | None = None  # see :meth:`watching`
    margin: SilenceMargin = field(default_factory=SilenceMargin)  # how near live members came to ``silent_s``

    def start(self) -> Membership:
        """Take part: generation 0 (its members, then its number) is written if nobody did yet, and the stamping
        starts. A newcomer (no members yet: :mod:`.joining`) only stamps."""
        if self.members:
            self.store.compare_set("gen0/members", "", json.dumps(self.members))
            self.store.compare_set("generation", "", "0")
            self.generation = int(self.store.get("generation"))
        self._stamp()
        self._thread = threading.Thread(target=self._run, name="stagewise-membership", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2 * STAMP_S)

    @property
    def rank(self) -> int:
        """This worker's rank in the current generation."""
        return self.members.index(self.me)

    def current(self) -> int:
        """The job's generation on the store."""
        return int(self.store.get("generation"))

    def fenced(self, what: str) -> None:
        """Raise :class:`Fenced` unless this worker is in the job's current generation (before ``what``)."""
        now = self.current()
        if now != self.generation:
            _last.append(f"worker {self.me} is fenced: generation {now} went on without it")
            raise Fenced(
                f"worker {self.me} is in generation {self.generation} but the job went on to generation {now} "
                f"without it (stopped or cut off meanwhile): it does not write {what}, and leaves"
            )

    def next(
        self, deadline_s: float, gone: Sequence[int] = (), still_gone: Callable[[], Sequence[int]] | None = None
    ) -> list[int]:
        """Agree with the other survivors on the next generation and its members (the survivors in id order);
        returns them, this worker among them, or raises :class:`Fenced`. Called by every survivor once it saw
        the current generation fail; waits at most ``deadline_s`` for the others to arrive. ``gone``: members
        already known dead (the heartbeat named them), not waited for unless they arrive anyway; ``still_gone``:
        asked again while waiting (evidence that cannot name a live member: a process's port that refuses; a
        machine's processes die one after another, so the failure may have named only the first)."""
        self.fenced("a request for the next generation")
        g = self.generation + 1
        self.store.set(f"gen{g}/arrived/{self.me}", "1")
        arrived = self._arrivals(g, deadline_s, set(gone), still_gone)
        proposal = self._proposal(arrived, joiners(self.store, g))
        won = self.store.compare_set(f"gen{g}/members", "", json.dumps(proposal)).decode()
        members = [int(m) for m in json.loads(won)]
        if self.me not in members and self.me in arrived and len(members) < len(arrived):
            why = f"left out of generation {g}: the layout cannot use its {len(arrived)} survivors, only {members}"
            _last.append(f"worker {self.me} is {why}")
            raise Fenced(f"worker {self.me} is {why}; it leaves (its machine may join again as a newcomer)")
        if self.me not in members:
            _last.append(f"worker {self.me} arrived too late for generation {g} (its members: {members})")
            raise Fenced(f"worker {self.me} arrived too late for generation {g} (its members: {members}); it leaves")
        return self.enter(g, members, deadline_s)

    def _proposal(self, arrived: list[int], newcomers: list[int]) -> list[int]:
        """The survivors and as many newcomers (lowest ids first) as leave a size the job can run at: a newcomer
        left out asks for the next generation (:func:`.joining.ask`); a size the layout cannot use would fail
        the build on every member, and the newcomers would leave."""
        joining = sorted(set(newcomers) - set(arrived))
        while joining and self.usable is not None and not self.usable(len(arrived) + len(joining)):
            joining.pop()
        return sorted([*self._runnable(arrived, len(joining)), *joining])

    def _runnable(self, arrived: list[int], joining: int) -> list[int]:
        """The survivors, or - when the layout cannot run on them (a member of a machine lost alone, or
        named silent while the rest of its machine lives) - the most of them it can run on: the members of
        machines no longer whole leave first, then the newest ids. The rest leave (fenced): a job that cannot
        run at its size would fail every generation it tries."""
        if self.usable is None or not arrived or self.usable(len(arrived) + joining):
            return arrived
        n = self.per_machine
        count = {m // n: sum(1 for a in arrived if a // n == m // n) for m in arrived} if n else {}
        order = sorted(arrived, key=lambda m: (bool(n) and count[m // n] == n, -m))  # the first to leave first
        for k in range(1, len(arrived)):
            if self.usable(len(arrived) - k + joining):
                gone = set(order[:k])
                return [m for m in arrived if m not in gone]
        return arrived  # (no size fits: the build refuses, with the layout's words)

    def speaks_for_machine(self, members: Sequence[int] | None = None, without: Sequence[int] = ()) -> bool:
        """Whether this worker says a generation's lines for its machine: the lowest id of its machine among
        ``members`` (default the generation's) less ``without`` (the lost), so that a machine's console reads one
        line where each of its workers would say the same (2026-12-04: 7 lines per survivor for a loss, 3 of them
        the same as another). Every worker speaks when the machine's size is unknown."""
        n = self.per_machine
        if not n:
            return True
        gone = set(without)
        mine = [m for m in (self.members if members is None else members) if m // n == self.me // n and m not in gone]
        return not mine or min(mine) == self.me

    def enter(self, g: int, members: list[int], deadline_s: float) -> list[int]:
        """Generation ``g`` of ``members`` (this worker among them), decided: the store's generation moves on, and
        every member passes the barrier (one missing at the deadline: one more generation without it)."""
        self.store.compare_set("generation", str(self.generation), str(g))
        missing = self.barrier(g, members, deadline_s)
        self.generation, self.members = g, members
        if missing:  # a member died during the recovery: one more generation, without it
            log.warning("stagewise elastic: workers %s did not reach generation %d; agreeing again", missing, g)
            return self.next(deadline_s)
        return members

    def _arrivals(
        self, g: int, deadline_s: float, known: set[int], still_gone: Callable[[], Sequence[int]] | None
    ) -> list[int]:
        """The members of the last generation that asked for ``g`` - waiting until every one either asked, went
        silent, or is gone by ``still_gone``'s evidence, or until the deadline; at once when another survivor
        already decided ``g`` (it saw evidence this one has not). How each was counted is kept in
        :attr:`decided` (what a recovery's record says)."""
        began = self.clock()
        end, named = began + deadline_s, set(known)
        with self._lock:  # what the stamping thread saw stand still before this agreement (see _silent)
            watch = dict(self._seen)
        self.decided, asked = {}, -_EVIDENCE_S
        while True:
            arrived = [m for m in self.members if self.store.check([f"gen{g}/arrived/{m}"])]
            now = self.clock()
            if self.store.check([f"gen{g}/members"]):  # another survivor decided already: its list stands, and
                for m in self.members:  # its barrier is waiting (this one must not wait out its own deadline first)
                    self.decided.setdefault(m, f"asked at {now - began:.2f} s" if m in arrived else "another decided")
                return arrived
            if still_gone is not None and now - asked >= _EVIDENCE_S and len(arrived) + len(known) < len(self.members):
                known |= set(still_gone())
                asked = self.clock()
            gone = [m for m in self.members if m in known and m not in arrived]
            for m in self.members:
                if m in arrived or m in known:
                    continue
                silent = self._silent(m, watch, now)
                if silent >= self.silent_s:
                    gone.append(m)
                    self.decided.setdefault(m, f"silent {silent:.2f} s")
            for m in arrived:
                self.decided.setdefault(m, f"asked at {now - began:.2f} s")
            for m in gone:
                self.decided.setdefault(m, "named dead" if m in named else f"port refuses at {now - began:.2f} s")
            if len(arrived) + len(gone) == len(self.members) or now >= end:
                for m in set(self.members) - set(self.decided):
                    self.decided[m] = f"missing at the deadline ({deadline_s:g} s)"
                return arrived
            self.sleep(_POLL_S)

    def _silent(self, m: int, watch: dict[int, tuple[bytes | None, float]], now: float) -> float:
        """How long member ``m`` has not stamped: since its stamp was first seen standing still here - by this
        agreement, or before it by the stamping thread (:meth:`look`) - or, once it stood still here for
        :data:`_CONFIRM_S`, by the stamp's own time (a stopped or cut-off machine's workers went silent
        together, a threshold ago, whichever the failure named). The confirmation spares a live member whose
        stamps waited behind its own store call (a barrier's wait holds the client) or whose clock is off; the
        stamps are wall-clock times, as the heartbeat's. Its clock starts when the silence was first seen, not
        when the agreement began: by then a member cut off a threshold ago has stood still that long here."""
        stamp = self.store.get(f"alive/{m}") if self.store.check([f"alive/{m}"]) else None
        if m not in watch or watch[m][0] != stamp:
            watch[m] = (stamp, now)
        still = now - watch[m][1]
        if stamp is None or still < _CONFIRM_S:
            return still
        try:
            return max(still, self.wall() - float(stamp))
        except ValueError:
            return still

    def look(self) -> None:
        """Read the other members' stamps (the stamping thread, every :data:`STAMP_S`): each one's value and
        since when (this worker's clock) it has stood still. Only unbroken watching counts: after a gap longer
        than :data:`_CONFIRM_S` in this worker's own looks (its store client was held by a barrier's wait, or
        the process was stopped) - a member seen standing still across it may have been held alike - every
        member is watched afresh."""
        now = self.clock()
        stamps = stamps_of(self.store, [m for m in self.members if m != self.me])
        done = self.clock()
        with self._lock:
            if self._looked < 0 or now - self._looked > _CONFIRM_S or done - now > STAMP_S:
                self._seen = {}
            for m, stamp in stamps.items():
                if m not in self._seen or self._seen[m][0] != stamp:  # (a move: alive, read still until the last look)
                    self.margin.moved(self._seen.get(m), self._looked, self.silent_s)
                    self._seen[m] = (stamp, done)
            self._looked = done

    @contextmanager
    def watching(self, report: Callable[[list[tuple[int, float]]], None]) -> Iterator[None]:
        """While inside (an in-place job's step): after each look, the stamping thread calls ``report`` with the
        ``(rank, seconds)`` of the members :meth:`silent` finds, ranks in the current generation - a stopped or
        cut-off machine ends the step at once, not at the hang threshold."""

        def told(silent: list[tuple[int, float]]) -> None:
            report([(self.members.index(m), s) for m, s in silent if m in self.members])

        self.on_silent = told
        try:
            yield
        finally:
            self.on_silent = None

    def silent(self) -> list[tuple[int, float]]:
        """``(id, seconds)`` of the other members whose stamp this worker's looks have seen standing still, unbroken,
        for ``silent_s`` or more (longest first): a stopped or cut-off machine's workers. [] right after a gap in
        this worker's own looks (:meth:`look` watches afresh then: this worker may have been the one held)."""
        now = self.clock()
        with self._lock:
            if self._looked < 0 or now - self._looked > _CONFIRM_S:
                return []
            still = [(m, now - since) for m, (_, since) in self._seen.items() if m != self.me and m in self.members]
        return sorted([(m, s) for m, s in still if s >= self.silent_s], key=lambda ms_: -ms_[1])

    def barrier(self, g: int, members: list[int], deadline_s: float) -> list[int]:
        """Every member of ``g`` says it is ready; the ones missing at the deadline (none when all came)."""
        self.store.set(f"gen{g}/ready/{self.me}", "1")
        keys = [f"gen{g}/ready/{m}" for m in members]
        try:
            self.store.wait(keys, timedelta(seconds=deadline_s))
            return []
        except Exception:  # a deadline: who is missing
            return [m for m, key in zip(members, keys, strict=True) if not self.store.check([key])]

    def _stamp(self) -> None:
        self.store.set(f"alive/{self.me}", repr(self.wall()))

    def _run(self) -> None:
        while not self._stop.wait(STAMP_S):
            try:
                with inside():  # (see ..comm.blocking: not in torch as the interpreter finalizes)
                    self._stamp()
            except Exception:  # the store is gone: the next agreement says so
                return
            try:
                with inside():
                    self.look()
            except Exception as err:  # (a look that failed only leaves the next agreement to watch afresh)
                log.debug("stagewise elastic: the others' stamps were not read (%s)", err)
                continue
            told = self.on_silent
            silent = self.silent() if told is not None else []
            if silent and told is not None:
                try:
                    told(silent)
                except Exception as err:  # (the step's own wait still ends at the hang threshold)
                    log.debug("stagewise elastic: a silent member was not reported (%s)", err)


def stamps_of(store: Any, ids: Sequence[int]) -> dict[int, bytes | None]:
    """The stamps of ``ids`` (None: not stamped yet) in two round trips to the store when all are there
    (``check`` of every key, one ``multi_get``), whatever the job's size: every worker reads the others'
    stamps every :data:`STAMP_S`, so one round trip per member would load the store as members squared."""
    keys = [f"alive/{m}" for m in ids]
    if keys and hasattr(store, "multi_get") and store.check(keys):
        return dict(zip(ids, store.multi_get(keys), strict=True))
    return {m: store.get(k) if store.check([k]) else None for m, k in zip(ids, keys, strict=True)}


def joiners(store: Any, g: int) -> list[int]:
    """The newcomers that asked for generation ``g`` (:mod:`.joining`): a proposal takes them in."""
    key = f"gen{g}/joiners"
    return [int(m) for m in json.loads(store.get(key))] if store.check([key]) else []


def named_dead(message: str, members: Sequence[int]) -> list[int]:
    """The members a failure's message names as dead by their rank in ``members`` (the heartbeat's words: "global
    ranks 1, 3 stopped or died"), as ids; [] when it names none."""
    ranks: list[int] = []
    for found in re.finditer(r"global ranks? ([\d, ]+) stopped or died", message):  # (every naming, in order)
        ranks += [int(r) for r in found.group(1).replace(" ", "").split(",") if r and int(r) not in ranks]
    return [members[r] for r in ranks if 0 <= r < len(members)]


_stamping: list[Membership] = []  # this process's memberships, stamping on a daemon thread


def stamping_until_exit(members: Membership) -> Membership:
    """``members``, whose stamping thread is stopped at interpreter exit (:func:`_stop_stamping`: registered at the
    first call, so that it runs before the exit hooks of the modules loaded until then, :mod:`..comm.blocking`'s)."""
    if not _stamping:
        atexit.unregister(_stop_stamping)
        atexit.register(_stop_stamping)
    _stamping.append(members)
    return members


def _stop_stamping() -> None:
    """At exit, while Python is whole: the membership's thread stops. A daemon thread that returns from a store call
    (the store releases the interpreter's lock while it waits for the host) as the interpreter finalizes is ended
    inside torch's C++ frames, and the process aborts ("terminate called without an active exception") after
    training to the end; the heartbeat's thread is stopped the same way, and a stamp stuck longer is waited for by
    the exit's settle (:mod:`..comm.blocking`)."""
    for members in _stamping:
        members.stop()
    _stamping.clear()
