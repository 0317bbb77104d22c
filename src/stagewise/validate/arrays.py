"""The validator's array path: every check of a complete schedule on whole numpy arrays, progress by certificate.

Why: the per-action scan of :mod:`stagewise.validate.fast` costs ~0.6 us per
action, over a second for the 1.8 M actions of a V schedule at 128 ranks x
1024 micro-batches. Here the actions are read into four columns (kind, stage,
micro-batch, rank) with C-level passes, and every check is a vector operation:

* placement and ranges: ``placement[stage] == rank``, micro-batches in 0..m-1;
* completeness: per (stage, micro-batch) one F, and one B or one I and one W (counts);
* local order: positions, e.g. ``pos[F of (s, i)] < pos[B of (s, i)]``, the receive
  before its consumer, the send after its producer, data order across stages held
  by one rank;
* communication: each value crossing ranks sent and received exactly once, and on
  each (sender, receiver) channel the sends and receives list the same messages in order;
* optimizer steps: few actions, checked one by one as the scan does;
* progress: a **certificate** instead of the rendezvous simulation. A batch is the
  run of communication actions before a compute action of a rank (and the run after
  its last one). Batch X of rank r completes once every op in it met its partner,
  i.e. once the partner's batch Y is posted, i.e. once the batch before Y (on the
  partner's rank) and the batch before X (on r) completed. Numbers c, one per
  batch, with c strictly increasing along each rank and c(X) > c(batch before Y)
  for every op of X, order all those dependencies: completing the batches in
  increasing c never waits on a later one, so the blocking, batched run finishes.
  Conversely a run that finishes gives such numbers (completion order). The
  lowering's uniform timing (:func:`stagewise.passes.reference._time_uniform`) is one such c.

The certificate is data, not trust: :func:`proves_valid` checks it like every
other fact, so any c (stale, edited, adversarial) that passes proves progress.
It answers only "proved valid" or "not proved"; on the latter the caller runs
the scan, which decides and, with the reference, names the problem. So nothing
valid is rejected here and nothing is accepted that the checks above do not prove. Property tests hold it
to the reference rule by rule (see :mod:`stagewise.validate`).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import numpy as np

from ..ir import Columns, Schedule, columns

_F, _B, _I, _W, _SEND_F, _RECV_F, _SEND_B, _RECV_B, _SYNC, _STEP = range(10)  # the codes of ir.columns.KINDS

#: per rank, one int per batch: the batches before each compute action, then the one after the last
Certificate = Sequence[Sequence[int]]


def proves_valid(schedule: Schedule, certificate: Certificate) -> bool:
    """True only when every check of the validator holds for ``schedule``, progress by ``certificate``.

    False means "not proved here" (a problem, a certificate that does not fit, or
    a form this path does not handle: compute-only, forward-only, one rank), not
    "invalid": the caller then runs the full scan.
    """
    sch = schedule
    if sch.meta.get("forward_only") or sch.num_ranks < 2:
        return False
    n, m, p = sch.num_stages, sch.num_microbatches, sch.num_ranks
    cols = columns(sch)
    if cols is None or len(certificate) != p or cols.kind.size == 0:
        return False
    plc = np.asarray(sch.placement, np.int64)
    if not _placed(cols, plc, n, m):
        return False
    k = _ByKind(cols, n, m)
    found = _backward_positions(k)  # completeness, and the local order of each (stage, micro-batch)'s own work
    if found is None:
        return False
    pos_f, pos_bi, pos_done = found
    f_cross = np.zeros(n, bool)  # input from another rank
    f_cross[1:] = plc[1:] != plc[:-1]
    b_cross = np.zeros(n, bool)  # output gradient from another rank
    b_cross[:-1] = plc[:-1] != plc[1:]
    received = _transfers(k, f_cross, b_cross, pos_f, pos_bi)
    if received is None or not _data_order_holds(k, f_cross, b_cross, pos_f, pos_bi, *received):
        return False
    paired = _channels_paired(k, cols, plc, p)
    if paired is None:
        return False
    # optimizer steps (few actions: one by one, as the scan does)
    if not sch.is_asynchronous and not _steps_hold(cols.kind, cols.stage, k.pos, pos_done, n, m):
        return False
    return _certificate_holds(cols, certificate, *paired)


def _placed(cols: Columns, plc: np.ndarray, n: int, m: int) -> bool:
    """Placement and ranges: every stage in 0..n-1 on its rank, every micro-batch in 0..m-1."""
    stage = cols.stage
    if stage.min() < 0 or stage.max() >= n or not np.array_equal(plc[stage], cols.rank):
        return False
    mb_acts = cols.microbatch[cols.kind < _SYNC]
    return not (mb_acts.size and (mb_acts.min() < 0 or mb_acts.max() >= m))


class _ByKind:
    """Per action kind c: the keys ``s * m + i`` of its actions and their positions (the global index, which the
    scan walks: the actions of one rank are contiguous and in order)."""

    def __init__(self, cols: Columns, n: int, m: int) -> None:
        self.n, self.m, self.nm = n, m, n * m
        self.pos = np.arange(cols.kind.size, dtype=np.int64)
        key = cols.stage * m + cols.microbatch
        sel = [cols.kind == c for c in range(10)]
        self.keys = [key[s] for s in sel]
        self.where = [self.pos[s] for s in sel]

    def once(self, c: int) -> np.ndarray | None:
        """Each key of kind c at most once: the positions by key (-1 where absent), or None on a repeat."""
        counts = np.bincount(self.keys[c], minlength=self.nm)
        if counts.size and counts.max() > 1:
            return None
        at = np.full(self.nm, -1, np.int64)
        at[self.keys[c]] = self.where[c]
        return at


def _backward_positions(k: _ByKind) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Completeness (one F each; one B, or one I and one W) and local order (backward after its forward, W after
    its I): per key the position of its F, of the backward that makes its input gradient (B or I) and of the one
    that finishes its weight gradient (B or W); None when a check fails."""
    keys, where = k.keys, k.where
    if keys[_F].size != k.nm:
        return None
    pos_f = k.once(_F)
    pos_b, pos_i, pos_w = k.once(_B), k.once(_I), k.once(_W)
    if pos_f is None or pos_b is None or pos_i is None or pos_w is None:
        return None
    has_b, has_i, has_w = pos_b >= 0, pos_i >= 0, pos_w >= 0
    if not np.all((has_b & ~has_i & ~has_w) | (~has_b & has_i & has_w)):
        return None
    if not (np.all(pos_f[keys[_B]] < where[_B]) and np.all(pos_f[keys[_I]] < where[_I])):
        return None
    if not np.all(pos_i[keys[_W]] < where[_W]):
        return None
    return pos_f, np.where(has_b, pos_b, pos_i), np.where(has_b, pos_b, pos_w)


def _transfers(
    k: _ByKind, f_cross: np.ndarray, b_cross: np.ndarray, pos_f: np.ndarray, pos_bi: np.ndarray
) -> tuple[np.ndarray, np.ndarray] | None:
    """Communication: each op only where a value crosses, once each, all of them; sends after what they send.
    The positions of each key's receive of its input and of its output gradient; None when a check fails."""
    keys, where, m = k.keys, k.where, k.m
    for c, cross in ((_SEND_F, b_cross), (_RECV_F, f_cross), (_SEND_B, f_cross), (_RECV_B, b_cross)):
        st = keys[c] // m
        if not np.all(cross[st]) or keys[c].size != m * int(cross.sum()):
            return None
    pos_sf, pos_rf, pos_sb, pos_rb = k.once(_SEND_F), k.once(_RECV_F), k.once(_SEND_B), k.once(_RECV_B)
    if pos_sf is None or pos_rf is None or pos_sb is None or pos_rb is None:
        return None
    # sends after what they send (receives are checked against their consumers by _data_order_holds)
    if not (np.all(pos_f[keys[_SEND_F]] < where[_SEND_F]) and np.all(pos_bi[keys[_SEND_B]] < where[_SEND_B])):
        return None
    return pos_rf, pos_rb


def _data_order_holds(
    k: _ByKind,
    f_cross: np.ndarray,
    b_cross: np.ndarray,
    pos_f: np.ndarray,
    pos_bi: np.ndarray,
    pos_rf: np.ndarray,
    pos_rb: np.ndarray,
) -> bool:
    """Data order on each rank: F after its input (received, or computed on this rank), B / I after its output
    gradient (the same)."""
    keys, where, m, n = k.keys, k.where, k.m, k.n
    s_idx = np.arange(n)
    kf = keys[_F]
    sf = kf // m
    remote = f_cross[sf]
    local = ~remote & ~(s_idx == 0)[sf]
    if not np.all(pos_rf[kf[remote]] < where[_F][remote]):
        return False
    if not np.all(pos_f[kf[local] - m] < where[_F][local]):
        return False
    kbk = np.concatenate((keys[_B], keys[_I]))
    wbk = np.concatenate((where[_B], where[_I]))
    sbk = kbk // m
    remote = b_cross[sbk]
    local = ~remote & ~(s_idx == n - 1)[sbk]
    if not np.all(pos_rb[kbk[remote]] < wbk[remote]):
        return False
    return bool(np.all(pos_bi[kbk[local] + m] < wbk[local]))


def _channels_paired(
    k: _ByKind, cols: Columns, plc: np.ndarray, p: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """Channel order: on each (sender, receiver) channel the sends and the receives list the same messages in
    order. The positions of the sends and of the receives, and the two orders that pair send k on a channel with
    receive k; None when they differ."""
    keys, where, m, n = k.keys, k.where, k.m, k.n
    send_msg = np.concatenate((2 * keys[_SEND_F], 2 * keys[_SEND_B] + 1))
    send_at = np.concatenate((where[_SEND_F], where[_SEND_B]))
    recv_msg = np.concatenate((2 * (keys[_RECV_F] - m), 2 * (keys[_RECV_B] + m) + 1))
    recv_at = np.concatenate((where[_RECV_F], where[_RECV_B]))
    order = np.argsort(send_at, kind="stable")
    send_msg, send_at = send_msg[order], send_at[order]
    order = np.argsort(recv_at, kind="stable")
    recv_msg, recv_at = recv_msg[order], recv_at[order]
    if send_msg.size != recv_msg.size:
        return None
    msg_stage = send_msg // (2 * m)
    to = np.where(send_msg % 2 == 0, msg_stage + 1, msg_stage - 1)  # the stage the message goes to
    send_chan = cols.rank[send_at] * p + plc[np.clip(to, 0, n - 1)]
    recv_chan = plc[recv_msg // (2 * m)] * p + cols.rank[recv_at]
    order_s = np.argsort(send_chan, kind="stable")
    order_r = np.argsort(recv_chan, kind="stable")
    if not (
        np.array_equal(send_chan[order_s], recv_chan[order_r]) and np.array_equal(send_msg[order_s], recv_msg[order_r])
    ):
        return None
    return send_at, recv_at, order_s, order_r


def _certificate_holds(
    cols: Columns,
    certificate: Certificate,
    send_at: np.ndarray,
    recv_at: np.ndarray,
    order_s: np.ndarray,
    order_r: np.ndarray,
) -> bool:
    """Progress by certificate (the module docstring): one number per batch, increasing along each rank, and each
    op's batch numbered above the batch before its partner's."""
    kind, rank, p = cols.kind, cols.rank, len(certificate)
    computing = kind < _SEND_F  # F, B, I, W
    n_compute = np.bincount(rank[computing], minlength=p)
    if not all(len(c) == k + 1 for c, k in zip(certificate, n_compute.tolist(), strict=True)):
        return False
    try:
        cert = np.fromiter(chain.from_iterable(certificate), np.int64, int(n_compute.sum()) + p)
    except (TypeError, ValueError, OverflowError):
        return False
    rank_start = np.zeros(p, np.int64)  # flat index of each rank's first batch
    rank_start[1:] = np.cumsum(n_compute + 1)[:-1]
    step = np.diff(cert)
    same_rank = np.ones(cert.size - 1, bool)
    same_rank[rank_start[1:] - 1] = False
    if not np.all(step[same_rank] > 0):
        return False
    # each op's batch, as a flat index: compute actions before it on its rank, plus its rank's offset
    comp_before: np.ndarray = np.cumsum(computing) - computing
    comp_base = np.zeros(p, np.int64)  # compute actions on the ranks before
    comp_base[1:] = np.cumsum(n_compute)[:-1]
    local_batch = comp_before - comp_base[rank]
    batch = rank_start[rank] + local_batch
    # send k on a channel meets receive k (checked above): pair them through the channel sort
    bs = batch[send_at][order_s]
    br = batch[recv_at][order_r]
    ls = local_batch[send_at][order_s]
    lr = local_batch[recv_at][order_r]
    has_before = lr > 0
    if not np.all(cert[bs[has_before]] > cert[br[has_before] - 1]):
        return False
    has_before = ls > 0
    return bool(np.all(cert[br[has_before]] > cert[bs[has_before] - 1]))


def _steps_hold(kind: np.ndarray, stage: np.ndarray, pos: np.ndarray, pos_done: np.ndarray, n: int, m: int) -> bool:
    """Each SYNC and each STEP after all its stage's backward, once, the SYNC never after the STEP; all stages or
    none, for each."""
    per_stage = np.nonzero(kind >= _SYNC)[0]
    stepped: dict[int, int] = {}
    synced: dict[int, int] = {}
    for at in per_stage.tolist():
        s = int(stage[at])
        if s in stepped or int(pos_done[s * m : (s + 1) * m].max()) > at:
            return False
        if kind[at] == _SYNC:
            if s in synced:
                return False
            synced[s] = at
        else:
            stepped[s] = at
    return (not stepped or len(stepped) == n) and (not synced or len(synced) == n)
