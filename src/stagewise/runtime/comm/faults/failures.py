"""A collective that failed inside torch, told as the pipeline's failure: whose it was, not where it surfaced.

FSDP2's all-gathers and reduce-scatters and DTensor's tensor-parallel
reductions are issued and waited for inside torch, on the main thread, with no
error board in sight: when a peer dies the wait raises gloo's "connection
closed by peer" at once, and when a peer is stopped it raises only when the
group's timeout passes (:func:`..groups.bound` makes that the pipeline's). Either
message names no rank, and a survivor posting it would blame itself. So such an
error is turned into a :class:`PipelineError` carrying the failure that stands:
one posted on the board (the origin's own message, or the coordinator being
unreachable), or else this rank's, led by the peers that stopped showing signs
of life (:mod:`.heartbeat`).
"""

from __future__ import annotations

import torch.distributed as dist

from ...errors import PipelineError
from . import divergence, heartbeat
from .guard import Guard

_SIGNS = ("gloo", "nccl", "connection closed", "connection reset", "timed out", "broken pipe")


def is_comm_error(err: BaseException) -> bool:
    """Whether ``err`` came from the communication backend (a torch.distributed error, or gloo's RuntimeError)."""
    if isinstance(err, PipelineError):
        return False
    if isinstance(err, dist.DistError):
        return True
    text = str(err).lower()
    return isinstance(err, RuntimeError) and any(sign in text for sign in _SIGNS)


def comm_failure(guard: Guard, err: BaseException, who: str) -> PipelineError:
    """The :class:`PipelineError` to raise for ``err`` (see the module docstring); posts it if none stands.

    ``guard``: the pipeline's (``transport.guard``); ``who``: this rank and action.
    """
    try:
        guard.check()  # a failure posted anywhere (or the coordinator gone) is the story
    except PipelineError as posted:
        return posted
    lines = str(err).strip().splitlines()
    brief = f"{type(err).__name__}: {lines[0] if lines else ''}"
    ended = divergence.blame_ended(guard.scope)  # no death: a script that ended (torch's words about a crash mislead)
    if ended:
        return PipelineError(guard.fail(f"{ended} ({who}: a collective inside torch failed)"))
    culprit = heartbeat.blame_failed(guard.timeout)
    text = f"{who}: a collective inside torch failed: {brief}"
    return PipelineError(guard.fail(f"{culprit}: {text}" if culprit else text))
