"""The communication pass on whole arrays: the timing loop on precomputed integers, the splice by positions.

Why: :mod:`stagewise._passes_reference` times each compute action with tuple
unpacking and kind tests, then splices each rank's sends and receives action by
action: two pure-Python passes, ~1.5 s for a V schedule at 128 ranks x 1024
micro-batches. Here every per-action fact the timing needs (the message a
compute waits for, the one it makes, its duration) is computed once with vector
operations, so the one loop that must stay sequential (the timing: a rank waits
for what another makes) touches three ints per action; the sends and receives
are then placed by computing every output position at once and filling one
object array. The result, schedule and certificate, is identical to the
reference's (a property test compares them).
"""

from __future__ import annotations

from collections import deque
from itertools import chain, repeat
from operator import itemgetter

import numpy as np

from .actions import Action, Kind
from .schedule import Schedule

_KINDS = (Kind.F, Kind.B, Kind.I, Kind.W, Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B, Kind.SYNC, Kind.STEP)
_CODE_BY_ID = {id(k): c for c, k in enumerate(_KINDS)}
_COMPUTE_FLAGS = bytes(1 if c < 4 else 0 for c in range(256))
_stage_of, _kind_of, _mb_of = itemgetter(0), itemgetter(1), itemgetter(2)


def add_communication(schedule: Schedule) -> tuple[list[list[Action]], list[list[int]]] | None:
    """Each rank's actions with its sends and receives, and the progress certificate; None if stuck.

    Same placement rule as :func:`stagewise.passes.add_communication` documents
    (and :mod:`stagewise._passes_reference` spells out): sends right after their
    producer, each receive in the first batch of its rank that starts once the
    value is made under uniform costs (F = I = W = 1, B = 2).
    """
    n, m, p, plc = schedule.num_stages, schedule.num_microbatches, schedule.num_ranks, schedule.placement
    ranks = schedule.ranks
    flat = chain.from_iterable
    lens = list(map(len, ranks))
    total = sum(lens)
    kb = bytes(map(_CODE_BY_ID.get, map(id, map(_kind_of, flat(ranks))), repeat(10)))  # 10: not a Kind
    compute_bytes = kb.translate(_COMPUTE_FLAGS)
    code = np.frombuffer(kb, np.uint8)
    is_compute = np.frombuffer(compute_bytes, np.uint8).astype(bool)
    n_compute = int(is_compute.sum())
    rank_of = np.repeat(np.arange(p, dtype=np.int64), lens)
    every = np.fromiter(flat(ranks), object, total)
    cacts = every[is_compute]
    listed = cacts.tolist()
    cs = np.fromiter(map(_stage_of, listed), np.int64, n_compute)
    ci = np.fromiter(map(_mb_of, listed), np.int64, n_compute)
    ck = code[is_compute]
    crank = rank_of[is_compute]
    per_rank = np.bincount(crank, minlength=p)
    base = np.zeros(p + 1, np.int64)
    base[1:] = np.cumsum(per_rank)

    # per stage: the base of the message F / (B, I) need and make across ranks, or -1 (same rank, or none)
    plc_a = np.asarray(plc, np.int64)
    s_idx = np.arange(n, dtype=np.int64)
    f_in = np.zeros(n, bool)
    f_in[1:] = plc_a[1:] != plc_a[:-1]  # input from another rank
    b_in = np.zeros(n, bool)
    b_in[:-1] = plc_a[:-1] != plc_a[1:]  # output gradient from another rank
    need_f = np.where(f_in, 2 * (s_idx - 1) * m, -1)
    need_b = np.where(b_in, 2 * (s_idx + 1) * m + 1, -1)
    make_f = np.where(b_in, 2 * s_idx * m, -1)
    make_b = np.where(f_in, 2 * s_idx * m + 1, -1)
    is_f = ck == 0
    is_bi = (ck == 1) | (ck == 2)
    nb = np.where(is_f, need_f[cs], np.where(is_bi, need_b[cs], -1))
    ob = np.where(is_f, make_f[cs], np.where(is_bi, make_b[cs], -1))
    need_a = np.where(nb >= 0, nb + 2 * ci, -1)
    make_a = np.where(ob >= 0, ob + 2 * ci, -1)
    took_a = np.where(ck == 1, 2, 1)
    base_l = base.tolist()
    timing = _time(need_a.tolist(), make_a.tolist(), took_a.tolist(), base_l, p, 2 * n * m)
    if timing is None:
        return None
    start_l = timing
    start = np.asarray(start_l, np.int64)

    # each receive: the first compute of its rank that starts no earlier than the value is made (at the
    # latest its consumer); receives sharing a slot go in the order their values were made: (time, rank,
    # index), and since ranks are numbered blocks of the global index, (time, global index of the producer)
    consumer = np.nonzero(need_a >= 0)[0]
    message = need_a[consumer]
    producer_of = np.zeros(2 * n * m, np.int64)
    producing = np.nonzero(make_a >= 0)[0]
    producer_of[make_a[producing]] = producing
    made_by_g = producer_of[message]
    ready = start[made_by_g] + took_a[made_by_g]  # when the producer ends
    c_rank = crank[consumer]
    # per rank searchsorted on the (increasing) start times, as one search over (rank, time) pairs
    horizon = int(took_a.sum()) + 1  # no start or end time exceeds all the work done one after another
    slot = np.searchsorted(crank * horizon + start, c_rank * horizon + ready)
    order = np.lexsort((made_by_g, ready, slot))  # slots are global: rank-major already
    recv_at_compute = slot[order]
    consumer = consumer[order]
    certificate = [start_l[a:b] for a, b in zip(base_l[:-1], base_l[1:], strict=True)]
    for rank, end in enumerate(_clock_ends(start, took_a, base_l)):
        certificate[rank].append(end)

    # the splice: per input action, receives placed before it and the send after it; outputs by position
    compute_at = np.nonzero(is_compute)[0]  # compute index (global) -> index among all input actions
    sends = make_a >= 0
    after = np.zeros(total, np.int64)
    after[compute_at[sends]] = 1
    recv_at = compute_at[recv_at_compute]  # the input action each receive goes before
    before = np.bincount(recv_at, minlength=total)
    out_at = np.arange(total, dtype=np.int64) + np.cumsum(before) + np.cumsum(after) - after
    n_out = total + int(before.sum()) + int(after.sum())
    out = np.empty(n_out, object)
    out[out_at] = every
    made_by = cacts[sends].tolist()
    send_kinds = np.where(is_f[sends], 4, 6).tolist()
    out[out_at[compute_at[sends]] + 1] = _retyped(made_by, send_kinds)
    if consumer.size:
        first = np.searchsorted(recv_at, recv_at)  # receives sharing a slot are adjacent, in order
        offset = np.arange(recv_at.size, dtype=np.int64) - first
        used_by = cacts[consumer].tolist()
        recv_kinds = np.where(is_f[consumer], 5, 7).tolist()
        out[out_at[recv_at] - before[recv_at] + offset] = _retyped(used_by, recv_kinds)
    ends = np.cumsum(np.bincount(rank_of, weights=before + after, minlength=p).astype(np.int64) + lens).tolist()
    flat_out = out.tolist()
    starts = [0, *ends[:-1]]
    return [flat_out[a:b] for a, b in zip(starts, ends, strict=True)], certificate


def _retyped(actions: list[Action], kinds: list[int]) -> np.ndarray:
    """An object array of ``Action(a.stage, kind, a.microbatch)``, made in C (``tuple.__new__`` on zipped fields)."""
    fields = zip(map(_stage_of, actions), map(_KINDS.__getitem__, kinds), map(_mb_of, actions), strict=True)
    return np.fromiter(map(tuple.__new__, repeat(Action), fields), object, len(actions))


def _clock_ends(start: np.ndarray, took: np.ndarray, base: list[int]) -> list[int]:
    """Each rank's end time: the end of its last compute action (0 for a rank without any)."""
    return [int(start[b - 1] + took[b - 1]) if b > a else 0 for a, b in zip(base[:-1], base[1:], strict=True)]


def _time(
    need: list[int], make: list[int], took: list[int], base: list[int], p: int, n_messages: int
) -> list[int] | None:
    """The uniform-cost timing of all compute actions (indexed globally, rank after rank).

    Each rank runs its compute actions in order; one that needs a message from another rank starts
    no earlier than the message is made. Returns the start time of every compute action, or None when
    some rank waits for a value that nobody makes first.
    """
    made = [-1] * n_messages
    start = [0] * base[-1]
    waiting: dict[int, int] = {}
    clock = [0] * p
    pos = base[:-1]
    queue = deque(range(p))
    while queue:
        rank = queue.popleft()
        g, end, t = pos[rank], base[rank + 1], clock[rank]
        while g < end:
            nb = need[g]
            if nb >= 0:
                ready = made[nb]
                if ready < 0:
                    waiting[nb] = rank
                    break
                if ready > t:
                    t = ready
            start[g] = t
            t += took[g]
            out = make[g]
            if out >= 0:
                made[out] = t
                if out in waiting:
                    queue.append(waiting.pop(out))
            g += 1
        clock[rank], pos[rank] = t, g
    return None if waiting else start
