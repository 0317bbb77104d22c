"""The one sequential loop of timing a schedule: every action as early as its rank and its input allow.

Why one function: the lowering times the compute order under uniform costs (to
place receives and to certify progress) and the simulator times it under a
cost model; both are the same longest-path walk over per-action integers, and
at 128 ranks x 1024 micro-batches it is the one part that cannot be a vector
operation (a rank waits for what another makes). Callers compute every
per-action fact with numpy first, so the loop touches five list items per action.

Why one zip per rank and not one loop over indices: at 0.4-0.5 us an action
this walk is most of the lowering's and the simulator's time on large
schedules, and iterating a zip is ~15 % cheaper than reading the lists by index.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from itertools import chain
from typing import Any, TypeVar

T = TypeVar("T", int, float)


def earliest_starts(
    need: Sequence[int],
    make: Sequence[int],
    took: Sequence[T],
    delay: Sequence[T],
    base: Sequence[int],
    n_messages: int,
    wire: Sequence[T] | None = None,
) -> tuple[list[T], list[int]]:
    """Each action's start time, and how far each rank got (``base[r + 1]`` when it finished).

    Actions are indexed globally, rank after rank (rank r holds ``base[r]`` to ``base[r + 1] - 1``). Action g
    starts when its rank is free and, if ``need[g] >= 0``, once message ``need[g]`` has arrived; it takes
    ``took[g]``, and if ``make[g] >= 0`` its message arrives ``delay[g]`` after it leaves: at once, or, with
    ``wire[g] > 0``, once the rank's earlier messages have (each holds the rank's link for its ``wire``: a link's
    bandwidth is shared, its latency is not). A rank that waits for a message nobody makes first stops there: its
    progress is short of its end, and its later start times are left at 0.
    """
    p = len(base) - 1
    arrival: list[Any] = [None] * n_messages
    start: list[Any] = [0] * base[-1]  # ints stay ints (the lowering's certificate), floats come with took
    waiting: dict[int, int] = {}
    clock: list[Any] = [0] * p
    lanes: list[Any] = [0] * p  # when each rank's link is free of the messages it already sent
    # one iterator per rank over its actions' facts; the action it blocked on is held aside, run first when woken
    rows = [
        zip(range(a, b), need[a:b], took[a:b], make[a:b], delay[a:b], strict=True)
        for a, b in zip(base[:-1], base[1:], strict=True)
    ]
    held: list[tuple[int, int, Any, int, Any] | None] = [None] * p
    queue = deque(range(p))
    while queue:
        rank = queue.popleft()
        t, lane = clock[rank], lanes[rank]
        blocked, held[rank] = held[rank], None
        # a woken rank runs its held action first (its message is there now), then goes on with its row
        for g, nb, tk, out, dl in rows[rank] if blocked is None else chain((blocked,), rows[rank]):
            if nb >= 0:
                ready = arrival[nb]
                if ready is None:
                    waiting[nb] = rank
                    held[rank] = (g, nb, tk, out, dl)
                    break
                if ready > t:
                    t = ready
            start[g] = t
            t += tk
            if out >= 0:
                wr = 0 if wire is None else wire[g]
                if not wr:
                    arrival[out] = t + dl
                else:  # behind the rank's earlier messages on its link
                    go = lane if lane > t else t
                    lane = go + wr
                    arrival[out] = go + dl
                if out in waiting:
                    queue.append(waiting.pop(out))
        clock[rank], lanes[rank] = t, lane
    reached = [base[r + 1] if h is None else h[0] for r, h in enumerate(held)]
    return start, reached
