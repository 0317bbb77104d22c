"""Compute orders as integer codes, timed by the simulator's own walk, with their activation memory.

A code is ``(stage * m + micro-batch) * 3 + kind`` with kind 0 = F, 1 = I, 2 = W: the search moves
thousands of them per second, so it keeps no :class:`~stagewise.ir.Action` objects until the end. Timing
is :func:`stagewise.simulation.earliest_starts`, the loop :func:`stagewise.simulation.simulate` runs, on the
same per-action facts, so a makespan found here is the simulator's.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

from ..ir import Action, Kind, Schedule
from ..simulation import earliest_starts
from .problem import MemoryLimit, Problem

F, I, W = 0, 1, 2  # noqa: E741 - the paper's name for the input-gradient pass
KINDS = (Kind.F, Kind.I, Kind.W)

#: per rank, its compute order as codes
Orders = list[list[int]]


class Instance:
    """Per-code facts of one problem: duration, the message it waits for and makes, and that message's delay."""

    def __init__(self, problem: Problem) -> None:
        self.problem = problem
        c, n, m = problem.search_costs, problem.num_stages, problem.microbatches
        plc = problem.placement
        self.n, self.m, self.p = n, m, problem.num_ranks
        size = 3 * n * m
        self.took = [0.0] * size
        self.need = [-1] * size
        self.make = [-1] * size
        self.delay = [0.0] * size
        for s in range(n):
            hop_f = c.transfer_time(s) if s + 1 < n and plc[s + 1] != plc[s] else 0.0
            hop_b = c.transfer_time(s - 1) if s > 0 and plc[s - 1] != plc[s] else 0.0
            for i in range(m):
                key = s * m + i
                f, inp, w = 3 * key, 3 * key + 1, 3 * key + 2
                self.took[f], self.took[inp], self.took[w] = c.forward[s], c.backward_input[s], c.backward_weight[s]
                if s > 0:
                    self.need[f] = 2 * (key - m)
                    self.make[inp], self.delay[inp] = 2 * key + 1, hop_b
                if s + 1 < n:
                    self.need[inp] = 2 * (key + m) + 1
                    self.make[f], self.delay[f] = 2 * key, hop_f

    def with_whole(self, keys: frozenset[int]) -> Instance:
        """This instance with the backward of each (stage, micro-batch) key in ``keys`` run whole: its I costs the
        stage's B (its gradient leaving at B's end), its W nothing."""
        if not keys:
            return self
        other = copy.copy(self)
        other.took = list(self.took)
        full, m = self.problem.search_costs.backward_times(), self.m
        for key in keys:
            other.took[3 * key + 1], other.took[3 * key + 2] = full[key // m], 0.0
        return other

    def times(self, orders: Orders) -> tuple[list[float], list[int]] | None:
        """Start times, rank after rank, and each rank's base index; None if the orders cannot finish."""
        flat = [code for acts in orders for code in acts]
        base = [0]
        for acts in orders:
            base.append(base[-1] + len(acts))
        took, need, make, delay = self.took, self.need, self.make, self.delay
        start, reached = earliest_starts(
            [need[c] for c in flat],
            [make[c] for c in flat],
            [took[c] for c in flat],
            [delay[c] for c in flat],
            base,
            2 * self.n * self.m,
        )
        if reached != base[1:]:
            return None
        return start, base

    def makespan(self, orders: Orders) -> float | None:
        """The simulator's makespan of ``orders`` (None: they cannot finish)."""
        timed = self.times(orders)
        if timed is None:
            return None
        return self._span(orders, *timed)[0]

    def score(self, orders: Orders) -> tuple[float, float] | None:
        """(makespan, sum of the ranks' ends): the search's objective, the second term breaking plateaus."""
        timed = self.times(orders)
        if timed is None:
            return None
        return self._span(orders, *timed)

    def _span(self, orders: Orders, start: list[float], base: list[int]) -> tuple[float, float]:
        ends = [start[b - 1] + self.took[orders[r][-1]] for r, b in enumerate(base[1:]) if b > base[r]]
        first = min(start[a] for r, a in enumerate(base[:-1]) if base[r + 1] > a)
        return max(ends) - first, sum(ends) - first * len(ends)


def peak(order: Sequence[int], limit: MemoryLimit, m: int) -> float:
    """The most activation memory a rank holds running ``order`` (it depends on the order alone): it rises at
    an F, and at an I whose stash outweighs the activations it frees."""
    add, keep = limit.add, limit.keep
    held = top = 0.0
    for code in order:
        s, kind = code // (3 * m), code % 3
        if kind == F:
            held += add[s]
            top = max(top, held)
        elif kind == I:
            held -= add[s] - keep[s]
            top = max(top, held)
        else:
            held -= keep[s]
    return top


def fits(order: Sequence[int], rank: int, problem: Problem) -> bool:
    """Whether rank ``rank`` running ``order`` stays within every memory cap."""
    m = problem.microbatches
    return all(peak(order, lim, m) <= lim.caps[rank] * (1 + 1e-9) + 1e-12 for lim in problem.limits)


def from_schedule(schedule: Schedule, m: int) -> Orders:
    """A compute-only schedule's orders as codes, each B split into I then W (the same time, an earlier send)."""
    out: Orders = []
    for acts in schedule.ranks:
        codes = []
        for a in acts:
            key = 3 * (a.stage * m + a.microbatch)  # type: ignore[operator]
            if a.kind is Kind.F:
                codes.append(key)
            elif a.kind is Kind.B:
                codes += [key + 1, key + 2]
            elif a.kind is Kind.I:
                codes.append(key + 1)
            elif a.kind is Kind.W:
                codes.append(key + 2)
        out.append(codes)
    return out


def to_actions(
    orders: Orders, m: int, fuse: frozenset[int] = frozenset(), whole: frozenset[int] = frozenset()
) -> list[list[Action]]:
    """Codes back to actions. The I of a stage in ``whole`` becomes a B and its W (free there) is dropped; an I
    directly followed by its own W becomes one B where its key is in ``fuse``."""
    ranks = []
    for acts in orders:
        out: list[Action] = []
        k = 0
        while k < len(acts):
            code = acts[k]
            key, kind = divmod(code, 3)
            s, i = divmod(key, m)
            if s in whole and kind != F:
                if kind == I:
                    out.append(Action(s, Kind.B, i))
                k += 1
                continue
            if kind == I and key in fuse and k + 1 < len(acts) and acts[k + 1] == code + 1:
                out.append(Action(s, Kind.B, i))
                k += 2
                continue
            out.append(Action(s, KINDS[kind], i))
            k += 1
        ranks.append(out)
    return ranks
