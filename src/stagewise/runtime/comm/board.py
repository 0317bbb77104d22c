"""The error board: one key in the c10d store where the first failure of any rank is posted for all to see.

No rank hangs when another fails: every blocking wait looks at the board
(:mod:`.waits`), and a failure anywhere stops every pipeline that shares the
board (all the pipelines of one mesh share one).
"""

from __future__ import annotations

import logging
from typing import Any

from ..errors import PipelineError
from .groups import default_store, prefix_store

log = logging.getLogger(__name__)

_ERROR_KEY = "error"


class ErrorBoard:
    """The first failure posted under ``name`` in ``store`` (the default group's store when None)."""

    def __init__(self, name: str, store: Any = None) -> None:
        self.store = prefix_store(f"stagewise/{name}/", default_store() if store is None else store)
        self.failure: str | None = None

    def fail(self, message: str) -> str:
        """Post ``message`` unless another rank's failure came first; returns the failure that stands."""
        try:
            stood = self.store.compare_set(_ERROR_KEY, "", message)
            self.failure = stood.decode() if isinstance(stood, bytes) else str(stood)
        except Exception as err:  # the store itself is gone: keep the local message
            log.warning("stagewise: could not post the failure to the store: %s", err)
            self.failure = message
        return self.failure

    def check(self) -> None:
        """Raise :class:`PipelineError` if any rank has posted a failure."""
        if self.failure is None and self.store.check([_ERROR_KEY]):
            self.failure = self.store.get(_ERROR_KEY).decode()
        if self.failure is not None:
            raise PipelineError(self.failure)
