"""Hang forensics: where one rank stood in its planned action list when the pipeline failed.

Every rank that raises :class:`~stagewise.PipelineError` appends its own
position to the failure that stands (the first one posted on the error board),
so a failed step can be read rank by rank against the schedule::

    rank 2: stage 1's output for micro-batch 2 from rank 1 failed: ... Connection closed by peer
    rank 3 at 3F2 (action 9 of 24; last completed: 3B0 (action 8 of 24)), waiting for stage 2's output for micro-batch 2
    from rank 2; planned: ... 3F1 3SEND_F1 3RECV_B1 3B1 3RECV_F2 >>3F2<< 3SEND_F2 3RECV_B2 3B2 ...
"""

from __future__ import annotations

from collections.abc import Sequence

from ...ir import Action

CONTEXT = 4  # planned actions shown on each side of the one a rank is in


def position(rank: int, actions: Sequence[Action], current: Action | None, done: Action | None, waiting: str) -> str:
    """One line: the action ``rank`` is in, its index in ``actions``, the last completed one and what it awaits."""
    n = len(actions)
    if n == 0:  # no step has run: there is no plan to place it in
        return f"rank {rank} before its first step" + (f", waiting for {waiting}" if waiting else "")
    at = _index(actions, current)
    last = "none" if done is None else f"{done} (action {_index(actions, done) + 1} of {n})"
    if current is None or current == done:  # between two actions, or after the last one
        where = f"rank {rank} after {last}"
        at = _index(actions, done)
    else:
        where = f"rank {rank} at {current} (action {at + 1} of {n}; last completed: {last})"
    wait = f", waiting for {waiting}" if waiting else ""
    return f"{where}{wait}; planned: {_window(actions, at)}"


def _index(actions: Sequence[Action], a: Action | None) -> int:
    if a is None:
        return -1
    try:
        return list(actions).index(a)
    except ValueError:  # e.g. a STEP appended to the schedule's list
        return -1


def _window(actions: Sequence[Action], at: int) -> str:
    if at < 0:
        return " ".join(str(a) for a in actions[: 2 * CONTEXT + 1]) + (" ..." if len(actions) > 2 * CONTEXT + 1 else "")
    lo, hi = max(0, at - CONTEXT), min(len(actions), at + CONTEXT + 1)
    parts = [f">>{a}<<" if k == at else str(a) for k, a in enumerate(actions[lo:hi], start=lo)]
    return ("... " if lo > 0 else "") + " ".join(parts) + (" ..." if hi < len(actions) else "")
