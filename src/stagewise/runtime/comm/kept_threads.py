"""Threads kept for the snapshots' short transfers, instead of one new thread per transfer.

Every snapshot ran five threads (each peer's transfer for the heads and again for the bytes, and the commit's
all-reduce: :mod:`.snapshot_wire`); a thread's start and end cost about 0.1 ms of CPU, which on one core per
rank is a step's time. Here a task goes to a kept thread that is free, or to a new one when every kept thread
is busy (a transfer given up may block until its deadline: nothing waits behind it); a kept thread with
nothing to do for :data:`IDLE_S` ends, so their number stays bounded by what ran at once. Each task runs at
the scheduling policy of the thread that handed it over, as a new thread would have inherited it (the
snapshot's helper runs at ``SCHED_IDLE``: :mod:`..elastic.idle`).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

IDLE_S = 5.0  # a kept thread with nothing to do for this long ends

_Task = tuple[Callable[[], None], "int | None"]


class Kept:
    """Kept threads named ``name``: :meth:`run` hands them tasks."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._free = 0  # threads waiting for a task and not yet promised one
        self._tasks: queue.SimpleQueue[_Task] = queue.SimpleQueue()

    def run(self, task: Callable[[], None]) -> None:
        """``task()`` on a free kept thread, else on a new one (``task`` handles its own errors)."""
        policy = _policy()
        with self._lock:
            if self._free:
                self._free -= 1  # (promised: the queue holds one task per waiting thread not counted free)
                self._tasks.put((task, policy))
                return
        threading.Thread(target=self._loop, args=((task, policy),), name=self.name, daemon=True).start()

    def _loop(self, first: _Task) -> None:
        task: _Task | None = first
        while task is not None:
            _adopt(task[1])
            task[0]()
            task = self._next()

    def _next(self) -> _Task | None:
        with self._lock:
            self._free += 1
        while True:
            try:
                return self._tasks.get(timeout=IDLE_S)
            except queue.Empty:
                with self._lock:
                    if self._free:  # not promised a task: this thread ends
                        self._free -= 1
                        return None
                # (promised one, being put: wait for it)


def _policy() -> int | None:
    """The calling thread's scheduling policy (None where the platform does not say)."""
    return os.sched_getscheduler(0) if hasattr(os, "sched_getscheduler") else None


def _adopt(policy: int | None) -> None:
    if policy is None or os.sched_getscheduler(0) == policy:
        return
    try:
        os.sched_setscheduler(0, policy, os.sched_param(0))
    except OSError as err:  # not allowed: it runs at its own
        log.debug("stagewise snapshots: a kept thread keeps its policy (%s)", err)
