"""The one error a pipeline raises on every rank when any rank fails."""

from __future__ import annotations


class PipelineError(RuntimeError):
    """A rank of the pipeline failed (or timed out); raised on every rank instead of hanging.

    The message names the rank and action where it started, e.g. ``rank 1 at
    1F0: stage 1 sent output[0] of shape (3, 16) for micro-batch 0, expected
    (4, 16) as on the first step``.
    """
