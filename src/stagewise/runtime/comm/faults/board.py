"""The error board: one key in the c10d store where the first failure of any rank is posted for all to see.

No rank hangs when another fails: every blocking wait looks at the board
(:mod:`.waits`), and a failure anywhere stops every pipeline that shares the
board (all the pipelines of one mesh share one). Besides its own key, every
board watches the run's *job* key, where a process posts the exception that
ends it (:mod:`.exit_hook`), so a rank that dies outside any step (in a
constructor, say) stops the others too.

Keys live under the run's scope on a connection of the board's own whose
calls time out (:mod:`.coordinator`): a board never reads a previous job's
failure, and never blocks past the pipeline's timeout on a stopped or dead
store host; it then says the coordinator is unreachable.
"""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist

from ...errors import PipelineError
from ..coordinator import UNREACHABLE, board_client
from . import heartbeat
from .exit_hook import mark_origin

log = logging.getLogger(__name__)

_ERROR_KEY = "error"
JOB_KEY = "job/error"
SEEN_KEY = "job/seen"  # job/seen/<global rank>: that rank has read a failure (the failing store host waits for them)


class ErrorBoard:
    """The first failure posted under ``name`` in ``store`` (the default group's when None), within the run."""

    def __init__(self, name: str, store: Any = None, timeout: float = 300.0, me: str = "") -> None:
        self.me = me  # how messages name this rank
        try:
            self.store = board_client(store, timeout)
        except PipelineError as err:
            raise PipelineError(f"{me}: {err}" if me else str(err)) from err
        self.key = f"{name}/{_ERROR_KEY}"
        self.failure: str | None = None
        heartbeat.start(timeout)  # so that a rank whose deadline passes can name the silent ones

    def fail(self, message: str) -> str:
        """Post ``message`` unless another rank's failure came first; returns the failure that stands."""
        if self.failure is not None:
            return self.failure
        try:
            if self.store.check([JOB_KEY]):  # a process already ended with an error: that one is the cause
                self.failure = self.store.get(JOB_KEY).decode()
                self._seen()
                return self.failure
            stood = self.store.compare_set(self.key, "", message)
            self.failure = stood.decode() if isinstance(stood, bytes) else str(stood)
            if self.failure == message:
                mark_origin()
            else:
                self._seen()
        except Exception as err:  # the store itself is gone: keep the local message
            log.warning("stagewise: could not post the failure to the store: %s", err)
            self.failure = f"{message}\n({UNREACHABLE}: other ranks may not see this failure)"
        return self.failure

    def check(self) -> None:
        """Raise :class:`PipelineError` if any rank has posted a failure (or the coordinator is unreachable)."""
        if self.failure is None:
            try:
                for key in (JOB_KEY, self.key):
                    if self.store.check([key]):
                        self.failure = self.store.get(key).decode()
                        self._seen()
                        break
            except Exception as err:
                who = f"{self.me}: " if self.me else ""
                self.failure = f"{who}{UNREACHABLE}: {_brief(err)}"
        if self.failure is not None:
            raise PipelineError(self.failure)

    def _seen(self) -> None:
        """Say that this rank has read the failure (the origin, maybe the store host, waits for its readers)."""
        self.store.set(f"{SEEN_KEY}/{dist.get_rank()}", "1")


def _brief(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"
