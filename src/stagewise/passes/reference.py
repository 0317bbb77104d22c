"""The communication pass written plainly, one action at a time: the reference for :mod:`stagewise.passes.arrays`.

:func:`stagewise.passes.lowering.add_communication` computes the same schedule (and the
same certificate) on whole arrays; a property test keeps the two identical on
random schedules.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import deque

from ..ir import COMPUTE, Action, Kind, Schedule

_F, _B, _W = Kind.F, Kind.B, Kind.W
_SEND_F, _SEND_B, _RECV_F, _RECV_B = Kind.SEND_F, Kind.SEND_B, Kind.RECV_F, Kind.RECV_B
_COMPUTE = COMPUTE


def add_communication_reference(schedule: Schedule) -> tuple[Schedule, list[list[int]]] | None:
    """The complete schedule and its progress certificate, or None when the compute order cannot finish."""
    timing = _time_uniform(schedule)
    if timing is None:
        return None
    recvs, certificate = timing
    ranks = [_with_comm(schedule, rank, pending) for rank, pending in enumerate(recvs)]
    return schedule.with_ranks(ranks), certificate


#: A receive to insert: (compute index it goes before, made-order key, the RECV action).
_Recv = tuple[int, int, Action]


def _time_uniform(schedule: Schedule) -> tuple[list[list[_Recv]], list[list[int]]] | None:
    """Time the compute actions (F = I = W = 1, B = 2, free transfers); per rank, its receives in order.

    The same timing as ``simulate(schedule.compute_only())``, on integers: a
    receive goes before the first compute action of its rank that starts no
    earlier than the value is made (never after its consumer), and receives
    sharing a slot go in the order their values were made (time, rank, index).
    Returns None when some rank waits for a value that nobody makes first. With the receives, per
    rank the start time of each compute action and the rank's end time: a progress certificate for
    the lowered schedule (the batch before compute k gets its start time; see stagewise.validate.arrays).
    """
    n, m, p = schedule.num_stages, schedule.num_microbatches, schedule.num_ranks
    need_f, need_b, make_f, make_b = _message_bases(schedule)
    compute = [[a for a in acts if a[1] in _COMPUTE] for acts in schedule.ranks]
    span = max(map(len, compute)) + 1
    per_time = p * span
    made = [-1] * (2 * n * m)  # message -> made-order key (end time, rank, compute index) as one int
    waiting: dict[int, int] = {}
    starts: list[list[int]] = [[] for _ in range(p)]
    recvs: list[list[_Recv]] = [[] for _ in range(p)]
    clock, pos = [0] * p, [0] * p
    new = tuple.__new__
    queue = deque(range(p))
    while queue:
        rank = queue.popleft()
        acts, t, k, end = compute[rank], clock[rank], pos[rank], len(compute[rank])
        began, pending = starts[rank], recvs[rank]
        while k < end:
            s, kind, i = acts[k]
            assert i is not None  # a compute action's micro-batch
            if kind is _F:
                nb, ob, took, rk = need_f[s], make_f[s], 1, _RECV_F
            elif kind is _W:
                nb = ob = -1
                took = 1
            else:
                nb, ob, took, rk = need_b[s], make_b[s], 2 if kind is _B else 1, _RECV_B
            if nb >= 0:
                key = made[nb + 2 * i]
                if key < 0:
                    waiting[nb + 2 * i] = rank
                    break
                ready = key // per_time
                # the first earlier start no sooner than ready; none (the slot is k) when the rank idled for it
                slot = k if not k or ready > began[-1] else bisect_left(began, ready)
                pending.append((slot, key, new(Action, (s, rk, i))))
                if ready > t:
                    t = ready
            began.append(t)
            t += took
            if ob >= 0:
                out = ob + 2 * i
                made[out] = (t * p + rank) * span + k
                if out in waiting:
                    queue.append(waiting.pop(out))
            k += 1
        clock[rank], pos[rank] = t, k
    return None if waiting else _finished(recvs, starts, clock)


def _finished(
    recvs: list[list[_Recv]], starts: list[list[int]], clock: list[int]
) -> tuple[list[list[_Recv]], list[list[int]]]:
    """Each rank's receives in placing order, and its start times closed by its end time (the certificate)."""
    for pending in recvs:
        pending.sort()  # nearly sorted already: by slot, then by when the value was made
    for began, t in zip(starts, clock, strict=True):
        began.append(t)
    return recvs, starts


def _message_bases(schedule: Schedule) -> tuple[list[int], list[int], list[int], list[int]]:
    """Per stage, the base of the message F needs, B/I need, F makes and B/I make across ranks (-1: none).

    Messages are ints ``2 * (s*m + i)`` (+1: input gradient); -1 when that value stays on the rank (or does not
    exist), so the timing loop adds ``2 * i`` to a base and tests its sign.
    """
    n, m, plc = schedule.num_stages, schedule.num_microbatches, schedule.placement
    last = n - 1
    need_f = [2 * (s - 1) * m if s > 0 and plc[s - 1] != plc[s] else -1 for s in range(n)]
    need_b = [2 * (s + 1) * m + 1 if s < last and plc[s + 1] != plc[s] else -1 for s in range(n)]
    make_f = [2 * s * m if s < last and plc[s + 1] != plc[s] else -1 for s in range(n)]
    make_b = [2 * s * m + 1 if s > 0 and plc[s - 1] != plc[s] else -1 for s in range(n)]
    return need_f, need_b, make_f, make_b


def _with_comm(schedule: Schedule, rank: int, recvs: list[_Recv]) -> list[Action]:
    """Rank ``rank``'s actions with each send right after its producer and the receives at their slots."""
    n, plc = schedule.num_stages, schedule.placement
    last = n - 1
    f_cross = [s < last and plc[s + 1] != plc[s] for s in range(n)]
    b_cross = [s > 0 and plc[s - 1] != plc[s] for s in range(n)]
    new = tuple.__new__
    out: list[Action] = []
    emit = out.append
    pending: Action | None = None
    nxt = 0  # next receive to place
    total = len(recvs)
    k = 0  # compute index
    for a in schedule.ranks[rank]:
        kind = a[1]
        if pending is not None:
            emit(pending)
            pending = None
        if kind in _COMPUTE:
            while nxt < total and recvs[nxt][0] == k:
                emit(recvs[nxt][2])
                nxt += 1
            emit(a)
            s = a[0]
            if kind is _F:
                if f_cross[s]:
                    pending = new(Action, (s, _SEND_F, a[2]))
            elif kind is not _W and b_cross[s]:
                pending = new(Action, (s, _SEND_B, a[2]))
            k += 1
        else:
            emit(a)
    if pending is not None:
        emit(pending)
    out.extend(r[2] for r in recvs[nxt:])
    return out
