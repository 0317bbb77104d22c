"""Waits with a deadline that watch the error board.

A gloo wait blocks its thread and cannot be interrupted (a wait with a timeout
closes the connection, and gloo's work objects cannot be polled: they report
completion only once waited on), so it runs on a helper thread while the
caller watches the board and the clock. Handing a wait to a helper costs two
thread wake-ups (hundreds of microseconds on a busy CPU), so a caller can
:meth:`Waits.watch` works it will need next: a helper waits for them in the
background, and the later :meth:`Waits.wait` returns at once if they are done.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch.distributed as dist

from ...errors import PipelineError
from ..coordinator import start_call
from . import heartbeat
from .board import ErrorBoard

T = TypeVar("T")

_POLL_S = 0.05  # how often a long wait looks at the error board, for its first second
_SLOW_POLL_S = 0.25  # and after that: every look is store calls on the host, which every waiting rank makes


def _poll_s(waited: float) -> float:
    return _POLL_S if waited < 1.0 else _SLOW_POLL_S


@dataclass
class Watch:
    """Works a helper thread is waiting for: ``event`` is set once they completed (or failed, with ``error``)."""

    works: Sequence[Any]
    waiter: _Waiter
    event: threading.Event
    error: BaseException | None = None


_setup_boards = 0


def setup_waits(timeout: float, store: Any = None) -> Waits:
    """Waits for a collective made before a pipeline's transport exists (the profile handed round, say).

    Its board is one of its own - named by a count every rank advances alike, as all build their pipelines in
    the same order - and, as every board, it watches the run's job key, where a process that dies of an
    exception posts it. Close it after use (:meth:`Waits.close`).
    """
    global _setup_boards
    _setup_boards += 1
    me = f"global rank {dist.get_rank()}"
    return Waits(ErrorBoard(f"setup/{_setup_boards - 1}", store, timeout, me), timeout, me)


class Waits:
    """Blocking waits on torch works, each bounded by ``timeout`` seconds and stopped by any posted failure."""

    def __init__(self, board: ErrorBoard, timeout: float, me: str) -> None:
        self.board = board
        self.timeout = timeout
        self.me = me  # how failure messages name this rank
        self.waiting = ""  # the last thing waited for, named in the hang report (see engine.forensics)
        self._waiters: list[_Waiter] = []

    def watch(self, works: Sequence[Any]) -> Watch:
        """Start waiting for ``works`` on a helper thread; pass the result to :meth:`wait`."""
        return self._submit(works)

    def wait(self, works: Sequence[Any], what: str, watch: Watch | None = None) -> None:
        """Block until ``works`` complete, raising :class:`PipelineError` on any rank's failure or the deadline."""
        self.waiting = what
        job = self._submit(works) if watch is None else watch
        if not job.event.is_set():
            started = time.perf_counter()
            while not job.event.wait(_poll_s(time.perf_counter() - started)):
                try:
                    self.check_deadline(started, what)
                except PipelineError:
                    if job.waiter in self._waiters:  # its thread is stuck in gloo; leave it behind
                        self._waiters.remove(job.waiter)
                    raise
        if job.error is not None:
            if self.board.failure is None:  # which peer went away? gloo does not say
                who = heartbeat.describe_stopped()
                raise PipelineError(self.board.fail(f"{self.me}: {what} failed: {job.error}{who}")) from job.error
            raise PipelineError(self.board.failure) from job.error

    def call(self, fn: Callable[[], T], what: str) -> T:
        """``fn()`` on a helper thread (left behind if it never returns), bounded like :meth:`wait`."""
        self.waiting = what
        done, box = start_call(fn)
        started = time.perf_counter()
        while not done.wait(_poll_s(time.perf_counter() - started)):
            self.check_deadline(started, what)
        if "error" in box:
            err = box["error"]
            raise PipelineError(self.board.fail(f"{self.me}: {what} failed: {err}")) from err
        return box["value"]

    def check_deadline(self, started: float, what: str) -> None:
        """Raise if a failure was posted, or post one if ``what`` has been waited for past the timeout."""
        self.board.check()
        waited = time.perf_counter() - started
        if waited > self.timeout:
            raise PipelineError(
                self.board.fail(
                    f"{self.me} waited {waited:.1f} s for {what}; is another rank stuck or dead? "
                    f"(timeout={self.timeout:g} s){heartbeat.describe_silent(self.timeout)}"
                )
            )

    def _submit(self, works: Sequence[Any]) -> Watch:
        """Give ``works`` to an idle helper (one that has finished all it was given), or to a new one."""
        for waiter in self._waiters:
            if waiter.idle:
                return waiter.submit(works)
        waiter = _Waiter()
        self._waiters.append(waiter)
        return waiter.submit(works)

    def close(self, join_s: float = 1.0) -> None:
        """Stop the helper threads and join the idle ones (a helper stuck in gloo after a failure is left)."""
        waiters, self._waiters = self._waiters, []
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
                for w in job.works:
                    w.wait()
            except BaseException as err:  # reported to the caller, who raises it
                job.error = err
            job.event.set()
