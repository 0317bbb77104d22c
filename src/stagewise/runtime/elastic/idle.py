"""Threads that run only in a core's idle time: the snapshots' helper thread and its gloo group's threads.

With one core per rank there is no spare core for a snapshot's copy, digest, file and send: at the
ordinary priority they take turns with the step's compute and lengthen it. Linux's ``SCHED_IDLE`` policy
runs a thread only when nothing else of its CPU wants to run, so the snapshot fills the step's idle time
(the pipeline's bubbles, the waits for a neighbour's activations) and the step loses only what the copy
costs the caches. A snapshot still unfinished when the next is due is waited for (the back-pressure is
:meth:`.snapshots.Snapshotter.after_step`'s): the training thread then sleeps, and the core is the
snapshot's. Elsewhere (no ``SCHED_IDLE``) threads keep their priority.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)

#: ``STAGEWISE_SNAPSHOT_IDLE=0`` keeps the snapshot's threads at the ordinary policy (a machine whose cores are
#: never idle: there the idle policy waits for the back-pressure to raise it)
ENV = "STAGEWISE_SNAPSHOT_IDLE"

#: the policy a snapshot's threads run at where the platform has it (None: left as they are)
POLICY: int | None = getattr(os, "SCHED_IDLE", None)


def wanted() -> bool:
    """Whether the snapshot's threads go idle: the platform has the policy and ``STAGEWISE_SNAPSHOT_IDLE`` is not 0."""
    return POLICY is not None and os.environ.get(ENV, "1") != "0"


def make_idle(tid: int = 0) -> bool:
    """Put thread ``tid`` (0: the calling thread; Linux applies the policy to one thread) at ``SCHED_IDLE``;
    whether it is."""
    if POLICY is None or not wanted():
        return False
    try:
        os.sched_setscheduler(tid, POLICY, os.sched_param(0))
    except OSError as err:  # gone already, or not allowed: it runs at its priority
        log.debug("stagewise snapshots: thread %d stays at its priority (%s)", tid, err)
        return False
    return True


def threads() -> set[int]:
    """This process's threads (Linux: ``/proc/self/task``; elsewhere empty)."""
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:
        return set()


@contextmanager
def new_threads_idle(made: list[int]) -> Iterator[None]:
    """The threads started inside the block (a gloo group's: its I/O loop and workers) put at ``SCHED_IDLE``;
    their ids appended to ``made``."""
    before = threads()
    yield
    if not wanted():
        return
    for tid in sorted(threads() - before):
        if make_idle(tid):
            made.append(tid)


class Priority:
    """A snapshotter's threads at ``SCHED_IDLE``, raised to the ordinary policy while the training thread waits
    for them (the back-pressure): on a loaded machine a core is never idle, and a wait on a thread that only
    gets idle time would last as long as the load."""

    def __init__(self) -> None:
        self.group: list[int] = []  # the snapshot group's gloo threads
        self.helper: int | None = None  # the running helper thread's id
        self.raised = False
        self.peers: set[int] = set()  # the running threads of the helper's copy to and from the peers
        self._lock = threading.Lock()

    def enter(self) -> int | None:
        """Called first by each helper thread: itself at ``SCHED_IDLE`` unless a wait has raised it; the policy
        it then runs at (None: unknown)."""
        with self._lock:
            self.helper = threading.get_native_id()
            if not self.raised:
                make_idle()
            return os.sched_getscheduler(0) if hasattr(os, "sched_getscheduler") else None

    def leave(self) -> None:
        """Called last by each helper thread: its id is not touched again (a thread id is reused, in any process,
        once the thread is gone)."""
        with self._lock:
            self.helper = None

    @contextmanager
    def peer_thread(self) -> Iterator[None]:
        """A thread the helper started for one peer's transfer (it inherited the helper's policy): raised with
        the helper while the training thread waits, forgotten when it ends."""
        tid = threading.get_native_id()
        with self._lock:
            self.peers.add(tid)
            if self.raised and wanted():
                _set(tid, os.SCHED_OTHER)
        try:
            yield
        finally:
            with self._lock:
                self.peers.discard(tid)

    @contextmanager
    def raised_while(self) -> Iterator[None]:
        """The threads at the ordinary policy for the block (a wait for them)."""
        with self._lock:
            self.raised = True
            tids = self._tids()
            for tid in tids if wanted() else []:
                _set(tid, os.SCHED_OTHER)
        try:
            yield
        finally:
            with self._lock:
                self.raised = False
                for tid in self._tids():
                    make_idle(tid)

    def _tids(self) -> list[int]:
        return [*self.group, *([self.helper] if self.helper is not None else []), *self.peers]


def _set(tid: int, policy: int) -> None:
    try:
        os.sched_setscheduler(tid, policy, os.sched_param(0))
    except OSError as err:
        log.debug("stagewise snapshots: thread %d keeps its policy (%s)", tid, err)


class Clock:
    """The calling thread's seconds, wall and CPU, per part of a snapshot, added to ``stats`` (``part`` and
    ``part_cpu``): where a snapshot's cost goes (benchmarks/recovery snapshots ``--breakdown``)."""

    def __init__(self, stats: dict[str, float]) -> None:
        self.stats, self.wall, self.cpu = stats, time.perf_counter(), time.thread_time()

    def lap(self, part: str) -> None:
        wall, cpu = time.perf_counter(), time.thread_time()
        self.stats[part] = self.stats.get(part, 0.0) + wall - self.wall
        self.stats[part + "_cpu"] = self.stats.get(part + "_cpu", 0.0) + cpu - self.cpu
        self.wall, self.cpu = wall, cpu
