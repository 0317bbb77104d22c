"""Windows of an asynchronous schedule: the version table and this rank's actions for a window of n mini-batches.

An asynchronous schedule is a *window* of N mini-batches (its version table says which weights each action
uses). A stream is trained N mini-batches at a time, each window one validated schedule; a window boundary
drains the pipeline: the next window starts with empty stages and versions counted afresh from the weights
(and optimizer state) the last one left, so the stream is trained exactly by the rule of
:mod:`stagewise.asynchronous.versions` applied window by window. Larger windows amortise the drain (bubble
(p - 1)/(N*m + p - 1)). A last, shorter window runs the same schedule over the mini-batches left
(:func:`stagewise.schedules.window_of`), lowered and validated like any other.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ...asynchronous import VersionTable
from ...ir import Action, Schedule
from ...passes import lower
from ...schedules import window_of
from ...validate import async_table, validate_versions


class Windows:
    """This rank's window action lists, one per window size, made (and validated) on first use.

    The train lists of the runner (:class:`~stagewise.runtime.engine.runner.TrainLists`): a train step of ``n``
    mini-batches runs the window of ``n``, its version table carried by the run (``run.table``: the
    version-aware handlers read it there).
    """

    def __init__(self, schedule: Schedule, rank: int) -> None:
        table = async_table(schedule)
        if table is None:
            raise ValueError(f"schedule {schedule.name!r} is synchronous: it has no windows")
        self.schedule, self.rank = schedule, rank
        self.size = table.minibatches
        self._made: dict[int, tuple[VersionTable, tuple[Action, ...]]] = {}

    def train(self, minibatches: int) -> tuple[tuple[Action, ...], int, VersionTable]:
        """The actions of the window of ``minibatches``, its micro-batches per mini-batch, its version table."""
        table, actions = self.get(minibatches)
        return actions, table.microbatches, table

    def get(self, n: int) -> tuple[VersionTable, tuple[Action, ...]]:
        """The version table and this rank's actions of the window of ``n`` mini-batches (1 <= n <= size)."""
        if not 1 <= n <= self.size:
            raise ValueError(f"a window of {self.schedule.name!r} holds 1 to {self.size} mini-batches, not {n}")
        if n not in self._made:
            schedule = self.schedule
            if n != self.size:
                schedule = lower(window_of(schedule, n))
                validate_versions(schedule)
            table = async_table(schedule)
            assert table is not None
            self._made[n] = (table, tuple(schedule.ranks[self.rank]))
        return self._made[n]


def windows_of(stream: Iterator[Any], size: int, steps: int | None) -> Iterator[list[Any]]:
    """``stream`` cut into windows of ``size`` items, ``steps`` items in all at most (None: until it ends)."""
    taken = 0
    while steps is None or taken < steps:
        want = size if steps is None else min(size, steps - taken)
        window = []
        for item in stream:
            window.append(item)
            if len(window) == want:
                break
        if not window:
            return
        yield window
        taken += len(window)
        if len(window) < want:
            return
