"""Helper threads that run blocking gloo waits, so that the caller can watch the error board and the clock.

A gloo wait blocks its thread and cannot be interrupted (a wait with a timeout
closes the connection, and gloo's work objects cannot be polled: they report
completion only once waited on), so it runs on a helper thread while the
caller (:meth:`.guard.Guard.wait`) watches the board and the deadline. Handing
a wait to a helper costs two thread wake-ups (hundreds of microseconds on a
busy CPU), so a caller can :meth:`.guard.Guard.watch` works it will need next:
a helper waits for them in the background, and the later wait returns at once
if they are done.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..blocking import inside

_POLL_S = 0.05  # how often a long wait looks at the error board, for its first second
_SLOW_POLL_S = 0.25  # and after that: every look is store calls on the host, which every waiting rank makes


def poll_s(waited: float) -> float:
    """How long a wait that has lasted ``waited`` seconds sleeps before it looks at the board again."""
    return _POLL_S if waited < 1.0 else _SLOW_POLL_S


@dataclass
class Watch:
    """Works a helper thread is waiting for: ``event`` is set once they completed (or failed, with ``error``)."""

    works: Sequence[Any]
    waiter: _Waiter
    event: threading.Event
    error: BaseException | None = None


class Waiters:
    """One guard's helper threads: a job goes to an idle one (it finished all it was given), or to a new one."""

    def __init__(self) -> None:
        self._all: list[_Waiter] = []

    def submit(self, works: Sequence[Any]) -> Watch:
        for waiter in self._all:
            if waiter.idle:
                return waiter.submit(works)
        waiter = _Waiter()
        self._all.append(waiter)
        return waiter.submit(works)

    def abandon(self, waiter: _Waiter) -> None:
        """Leave ``waiter`` behind: its thread is stuck in gloo (the wait it ran was given up)."""
        if waiter in self._all:
            self._all.remove(waiter)

    def close(self, join_s: float = 1.0) -> None:
        """Stop the helper threads and join the idle ones (a helper stuck in gloo after a failure is left)."""
        waiters, self._all = self._all, []
        for waiter in waiters:
            waiter.stop()
        deadline = time.perf_counter() + join_s
        for waiter in waiters:
            if waiter.idle:
                waiter.join(max(0.0, deadline - time.perf_counter()))


class _Waiter:
    """A daemon thread that runs blocking gloo waits, one job at a time, on the caller's behalf."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Watch | None] = queue.SimpleQueue()
        self._last: Watch | None = None
        self._thread = threading.Thread(target=self._run, name="stagewise-wait", daemon=True)
        self._thread.start()

    @property
    def idle(self) -> bool:
        """True when every job given so far has finished."""
        return self._last is None or self._last.event.is_set()

    def submit(self, works: Sequence[Any]) -> Watch:
        job = Watch(works, self, threading.Event())
        self._last = job
        self._jobs.put(job)
        return job

    def stop(self) -> None:
        self._jobs.put(None)

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                with inside():  # a wait left stuck here must not be in gloo when the interpreter finalizes
                    _wait_all(job.works)
            except BaseException as err:  # reported to the caller, who raises it
                job.error = err
            job.works = ()  # done: the buffers they wrote are the caller's, not this thread's to keep alive
            job.event.set()
            job = None  # (held while this thread waits for the next job, it would keep them alive until then)


def _wait_all(works: Sequence[Any]) -> None:
    for w in works:
        w.wait()
