"""The error board: one key in the c10d store where the first failure of any rank is posted for all to see.

No rank hangs when another fails: every blocking wait looks at the board
(through the pipeline's :class:`~.guard.Guard`), and a failure anywhere stops every pipeline that shares the
board (all the pipelines of one mesh share one). Besides its own key, every
board watches the run's *job* key, where a process posts the exception that
ends it (:mod:`.exit_hook`), so a rank that dies outside any step (in a
constructor, say) stops the others too.

Keys live under the run's scope on a connection of the board's own whose
calls time out (:mod:`..coordinator`): a board never reads a previous job's
failure, and never blocks past the pipeline's timeout on a stopped or dead
store host; it then says the coordinator is unreachable.

What must happen as soon as a rank learns of a failure, wherever it learns
it (the shm transport removing its names from /dev/shm, say), is asked for
with :meth:`ErrorBoard.when_failed`: the board is the one place a failure
becomes known, whether posted here or read from the store.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from ...errors import PipelineError
from ..coordinator import UNREACHABLE, board_client
from .exit_hook import mark_origin, note_failure, remember_board, remember_store
from .keys import JOB_KEY, SEEN_KEY

log = logging.getLogger(__name__)

_ERROR_KEY = "error"


class ErrorBoard:
    """The first failure posted under ``name`` in ``store`` (the default group's when None), within the run."""

    def __init__(self, name: str, store: Any = None, timeout: float = 300.0, me: str = "") -> None:
        self.me = me  # how messages name this rank
        try:
            self.store = board_client(store, timeout)
        except PipelineError as err:
            raise PipelineError(f"{err} (seen by {me})" if me else str(err)) from err
        remember_store(self.store.store)  # a process leaving with an error posts it where this board looks
        remember_board(self)  # and acts on it here first (the shm names go), as on any failure
        self.name = name
        self.key = f"{name}/{_ERROR_KEY}"
        self.failure: str | None = None
        self._on_failure: list[Callable[[], None]] = []
        self._look: Any = None  # the keys' read in flight (:meth:`poll`), a coordinator.Posted
        self._polling = threading.RLock()  # (RLock: a failure's callbacks may look at the board again)

    def close(self) -> None:
        """Let go of the store's helper thread (a later read or post starts another)."""
        close = getattr(self.store, "close", None)
        if close is not None:
            close()

    def when_failed(self, fn: Callable[[], None]) -> None:
        """Run ``fn()`` once this board knows a failure (at once if it already does): posted here or read."""
        if self.failure is not None:
            fn()
        else:
            self._on_failure.append(fn)

    def _stand(self, failure: str) -> str:
        """``failure`` is the one that stands, for this board: remember it and tell whoever asked to know."""
        self.failure = failure
        note_failure(failure)  # this process leaves in order, without an abort, however it ends; the launcher is told
        todo, self._on_failure = self._on_failure, []
        for fn in todo:
            try:
                fn()
            except Exception as err:  # cleaning up must not hide the failure itself
                log.warning("stagewise: acting on a failure failed: %s: %s", type(err).__name__, err)
        return failure

    def leaving(self, failure: str) -> None:
        """This process leaves with ``failure`` (the exit hook): unless a failure stands here already, it does now,
        locally - what must happen on a failure happens before the process is gone (no store call: the hook
        posts to the job's key itself)."""
        if self.failure is None:
            self._stand(failure)

    def fail(self, message: str) -> str:
        """Post ``message`` unless another rank's failure came first; returns the failure that stands."""
        if self.failure is not None:
            return self.failure
        try:
            if self.store.check([JOB_KEY]):  # a process already ended with an error: that one is the cause
                failure = self._stand(self.store.get(JOB_KEY).decode())
                self._seen()
                return failure
            stood = self.store.compare_set(self.key, "", message)
            failure = self._stand(stood.decode() if isinstance(stood, bytes) else str(stood))
            if failure == message:
                mark_origin(self.store)
            else:
                self._seen()
        except Exception as err:  # the store itself is gone: keep the local message
            log.warning("stagewise: could not post the failure to the store: %s", err)
            failure = self._stand(f"{message}\n({UNREACHABLE}: other ranks may not see this failure)")
        return failure

    def check(self) -> None:
        """Raise :class:`PipelineError` if any rank has posted a failure (or the coordinator is unreachable)."""
        if self.failure is None:
            try:
                for key in (JOB_KEY, self.key):
                    if self.store.check([key]):
                        self._stand(self.store.get(key).decode())
                        self._seen()
                        break
            except Exception as err:  # the coordinator first: it is the one at fault, not this rank
                seen = f" (seen by {self.me})" if self.me else ""
                self._stand(f"{UNREACHABLE}{seen}: {_brief(err)}")
        if self.failure is not None:
            raise PipelineError(self.failure)

    def poll(self, finish: bool = False) -> None:
        """:meth:`check` for a wait's poll, without blocking on the store: what the last read found stands now (and
        raises), and the next read is posted to the store's helper thread. Why: a read is a round trip (two, one
        per key) to the store host, and a wait that reads in its own thread does not notice its works completing
        until the reads return: on a machine 10 ms from the store host every poll of a wait longer than 50 ms
        held the step 40 ms (issue 49, 2026-12-05: the pipeline's transfers inside the far machine).
        ``finish`` (a wait past its deadline): the read is waited for, up to the store's timeout from when it was
        posted, as a blocking :meth:`check` would be: a store host that does not answer is then the cause named."""
        if finish and self.failure is None:
            with self._polling:
                self._advance(False)  # post one (or take what stands)
                look = self._look
            if look is not None:  # (waited for outside the lock: another thread's poll does not block on it)
                look.done.wait(max(0.0, self.store.timeout - (time.perf_counter() - look.started)))
        with self._polling:
            self._advance(finish)
        if self.failure is not None:
            raise PipelineError(self.failure)

    def _advance(self, finish: bool) -> None:
        """:meth:`poll`'s step under its lock (one read in flight, one failure stood, whichever threads poll):
        take the read in flight if it is done (or, ``finish``, give up on it), and post the next."""
        if self.failure is None and self._look is not None:
            look = self._look
            if look.done.is_set():
                self._look = None
                try:
                    found = look.result()
                except Exception as err:  # the coordinator first: it is the one at fault, not this rank
                    seen = f" (seen by {self.me})" if self.me else ""
                    self._stand(f"{UNREACHABLE}{seen}: {_brief(err)}")
                else:
                    if found is not None:
                        self._stand(found)
                        try:
                            self._seen()
                        except Exception as err:  # the failure stands; its origin's wait for readers times out
                            log.warning("stagewise: could not say that this rank read the failure: %s", err)
            elif finish or time.perf_counter() - look.started > self.store.timeout:
                self.store.stuck()
                seen = f" (seen by {self.me})" if self.me else ""
                self._stand(f"{UNREACHABLE}{seen}: the store did not answer within {self.store.timeout:g} s")
        if self.failure is None and self._look is None:
            keys = (JOB_KEY, self.key)
            try:
                self._look = self.store.post(lambda store: _first_posted(store, keys))
            except Exception as err:  # a read before this one never returned
                seen = f" (seen by {self.me})" if self.me else ""
                self._stand(f"{UNREACHABLE}{seen}: {_brief(err)}")

    def _seen(self) -> None:
        """Say that this rank has read the failure (the origin, maybe the store host, waits for its readers)."""
        self.store.set(f"{SEEN_KEY}/{dist.get_rank()}", "1")


def _first_posted(store: Any, keys: tuple[str, ...]) -> str | None:
    """The failure under the first of ``keys`` that holds one (``store``: the board's own, on its helper thread)."""
    for key in keys:
        if store.check([key]):
            return store.get(key).decode()
    return None


def _brief(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"
