"""When a reduction the step waits for outside every rank's action list is done: one rule for every timed step.

The gradient sum of parameters tied across stages (an embedding and the head reusing it:
:mod:`stagewise.planning.tied_sum`) is no action. The runtime (:mod:`stagewise.runtime.frontends.tied`) starts it
once each rank holding one of its stages has run that stage's SYNC, and every one of them waits for it before the
step ends. So a stage lets it start at its SYNC's start; in a list without SYNC, at its last compute action's end.
:func:`stagewise.simulation.shared_makespan` (its replay) and the planner's simulated step
(:func:`stagewise.planning.predict.ends_with_async_sync`) both time it here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from ..ir import Action, Kind

__all__ = ["Timed", "tied_done"]


class Timed(Protocol):
    """A timed step: per rank, its actions that take rank time (no SEND or RECV), in order, each one's start and
    end (:class:`~stagewise.simulation.SimResult` is one)."""

    @property
    def actions(self) -> Sequence[Sequence[Action]]: ...

    @property
    def starts(self) -> Sequence[Sequence[float]]: ...

    @property
    def ends(self) -> Sequence[Sequence[float]]: ...


def tied_done(timed: Timed, tied: Sequence[tuple[Sequence[int], float]]) -> tuple[float, ...]:
    """Per reduction ``(stages, seconds)`` of ``tied``, when it is done on ``timed``: ``seconds`` after the last of
    its stages lets it start (module docstring); ``-inf`` where none of its stages ran."""
    if not tied:
        return ()
    start: dict[int, float] = {}
    for acts, starts, ends in zip(timed.actions, timed.starts, timed.ends):
        synced = any(a.kind is Kind.SYNC for a in acts)
        for a, begin, end in zip(acts, starts, ends):
            if a.kind is Kind.SYNC:
                start[a.stage] = begin
            elif not synced and a.kind is not Kind.STEP:
                start[a.stage] = end
    out = []
    for stages, seconds in tied:
        started = [start[s] for s in stages if s in start]
        out.append(max(started) + seconds if started else -float("inf"))
    return tuple(out)
