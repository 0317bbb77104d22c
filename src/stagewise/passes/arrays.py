"""The communication pass on whole arrays: the timing loop on precomputed integers, the splice by positions.

Why: :mod:`stagewise.passes.reference` times each compute action with tuple
unpacking and kind tests, then splices each rank's sends and receives action by
action: two pure-Python passes, ~1.5 s for a V schedule at 128 ranks x 1024
micro-batches. Here every per-action fact the timing needs (the message a
compute waits for, the one it makes, its duration) is computed once with vector
operations, so the one loop that must stay sequential (the timing: a rank waits
for what another makes) touches a few list items per action; the sends and receives
are then placed by computing every output position at once and filling
the output columns (no action objects: :class:`stagewise.ir.columns.ActionRows`
makes a rank's row when it is asked for). The result, schedule and
certificate, is identical to the reference's (a property test compares them).
"""

from __future__ import annotations

import numpy as np

from ..ir import RECV_B as _RECV_B
from ..ir import RECV_F as _RECV_F
from ..ir import SEND_B as _SEND_B
from ..ir import SEND_F as _SEND_F
from ..ir import Columns, Schedule
from ..simulation import earliest_starts


class MadeTwice(ValueError):
    """Two compute actions make the same value: which one a receive waits for depends on the order the
    timing visits the ranks in, which only the plain pass follows (the validator then names the duplicate)."""


def add_communication(cols: Columns, schedule: Schedule) -> tuple[Columns, list[list[int]]] | None:
    """The actions with their sends and receives, as columns, and the progress certificate; None if stuck.

    ``cols`` are ``schedule``'s columns (:func:`stagewise.ir.columns.columns`).

    Same placement rule as :func:`stagewise.passes.lowering.add_communication` documents
    (and :mod:`stagewise.passes.reference` spells out): sends right after their
    producer, each receive in the first batch of its rank that starts once the
    value is made under uniform costs (F = I = W = 1, B = 2). Raises :class:`MadeTwice` when two
    actions make one value.
    """
    n, m, p = schedule.num_stages, schedule.num_microbatches, schedule.num_ranks
    c = _ComputeFacts(cols, schedule)
    made = c.make[c.make >= 0]
    if made.size and int(np.bincount(made).max()) > 1:
        raise MadeTwice(f"schedule {schedule.name!r}: a value is made by two actions")
    base_l = c.base.tolist()
    start_l, reached = earliest_starts(
        c.need.tolist(), c.make.tolist(), c.took.tolist(), [0] * c.stage.size, base_l, 2 * n * m
    )
    if reached != base_l[1:]:  # some rank waits for a value nobody makes first
        return None
    start = np.fromiter(start_l, np.int64, c.stage.size)
    consumer, recv_at_compute = _receive_slots(c, start, 2 * n * m)
    certificate = [start_l[a:b] for a, b in zip(base_l[:-1], base_l[1:], strict=True)]
    for rank, end in enumerate(_clock_ends(start, c.took, base_l)):
        certificate[rank].append(end)
    return _splice(cols, c, consumer, recv_at_compute, p), certificate


class _ComputeFacts:
    """Per compute action (F, B, I, W), in the columns' order: what the timing needs, as arrays.

    ``need`` / ``make``: the message it waits for / makes across ranks, or -1; messages are ints
    ``2 * (s * m + i)`` (+1: an input gradient). ``took``: its duration (B = 2, others 1).
    """

    def __init__(self, cols: Columns, schedule: Schedule) -> None:
        n, m, p, plc = schedule.num_stages, schedule.num_microbatches, schedule.num_ranks, schedule.placement
        self.is_compute = cols.kind < _SEND_F
        self.stage, self.microbatch = cols.stage[self.is_compute], cols.microbatch[self.is_compute]
        self.kind, self.rank = cols.kind[self.is_compute], cols.rank[self.is_compute]
        self.base = np.zeros(p + 1, np.int64)
        self.base[1:] = np.cumsum(np.bincount(self.rank, minlength=p))
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
        cs, ck = self.stage, self.kind
        self.is_f = ck == 0
        is_bi = (ck == 1) | (ck == 2)
        nb = np.where(self.is_f, need_f[cs], np.where(is_bi, need_b[cs], -1))
        ob = np.where(self.is_f, make_f[cs], np.where(is_bi, make_b[cs], -1))
        self.need = np.where(nb >= 0, nb + 2 * self.microbatch, -1)
        self.make = np.where(ob >= 0, ob + 2 * self.microbatch, -1)
        self.took = np.where(ck == 1, 2, 1)


def _receive_slots(c: _ComputeFacts, start: np.ndarray, n_messages: int) -> tuple[np.ndarray, np.ndarray]:
    """The compute actions that receive (in the order their receives go), and the compute each receive goes
    before.

    Each receive: the first compute of its rank that starts no earlier than the value is made (at the
    latest its consumer); receives sharing a slot go in the order their values were made: (time, rank,
    index), and since ranks are numbered blocks of the global index, (time, global index of the producer).
    """
    consumer = np.nonzero(c.need >= 0)[0]
    message = c.need[consumer]
    producer_of = np.zeros(n_messages, np.int64)
    producing = np.nonzero(c.make >= 0)[0]
    producer_of[c.make[producing]] = producing
    made_by_g = producer_of[message]
    ready = start[made_by_g] + c.took[made_by_g]  # when the producer ends
    c_rank = c.rank[consumer]
    # per rank searchsorted on the (increasing) start times, as one search over (rank, time) pairs
    horizon = int(c.took.sum()) + 1  # no start or end time exceeds all the work done one after another
    slot = np.searchsorted(c.rank * horizon + start, c_rank * horizon + ready)
    order = np.lexsort((made_by_g, ready, slot))  # slots are global: rank-major already
    return consumer[order], slot[order]


def _splice(cols: Columns, c: _ComputeFacts, consumer: np.ndarray, recv_at_compute: np.ndarray, p: int) -> Columns:
    """The output columns: per input action, the receives placed before it and the send after it, by position."""
    total = cols.kind.size
    compute_at = np.nonzero(c.is_compute)[0]  # compute index (global) -> index among all input actions
    sends = c.make >= 0
    after = np.zeros(total, np.int64)
    after[compute_at[sends]] = 1
    recv_at = compute_at[recv_at_compute]  # the input action each receive goes before
    before = np.bincount(recv_at, minlength=total)
    out_at = np.arange(total, dtype=np.int64) + np.cumsum(before) + np.cumsum(after) - after
    n_out = total + int(before.sum()) + int(after.sum())
    kind, stage, mb = np.empty(n_out, np.uint8), np.empty(n_out, np.int64), np.empty(n_out, np.int64)
    kind[out_at], stage[out_at], mb[out_at] = cols.kind, cols.stage, cols.microbatch
    cs, ci = c.stage, c.microbatch
    at = out_at[compute_at[sends]] + 1  # each send right after the compute that made its value
    kind[at], stage[at], mb[at] = np.where(c.is_f[sends], _SEND_F, _SEND_B), cs[sends], ci[sends]
    if consumer.size:
        first = np.searchsorted(recv_at, recv_at)  # receives sharing a slot are adjacent, in order
        at = out_at[recv_at] - before[recv_at] + np.arange(recv_at.size, dtype=np.int64) - first
        kind[at], stage[at], mb[at] = np.where(c.is_f[consumer], _RECV_F, _RECV_B), cs[consumer], ci[consumer]
    out_base = np.zeros(p + 1, np.int64)
    lens = np.diff(cols.base)
    np.cumsum(np.bincount(cols.rank, weights=before + after, minlength=p).astype(np.int64) + lens, out=out_base[1:])
    return Columns(kind=kind, stage=stage, microbatch=mb, base=out_base)


def _clock_ends(start: np.ndarray, took: np.ndarray, base: list[int]) -> list[int]:
    """Each rank's end time: the end of its last compute action (0 for a rank without any)."""
    return [int(start[b - 1] + took[b - 1]) if b > a else 0 for a, b in zip(base[:-1], base[1:], strict=True)]
