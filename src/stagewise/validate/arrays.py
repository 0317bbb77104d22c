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
  lowering's uniform timing (:func:`stagewise.passes.lowering._time_uniform`) is one such c.

The certificate is data, not trust: :func:`proves_valid` checks it like every
other fact, so any c (stale, edited, adversarial) that passes proves progress.
It answers only "proved valid" or "not proved"; on the latter the caller runs
the scan, which decides and, with the reference, names the problem. So nothing
valid is rejected here and nothing is accepted that the checks above do not prove.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import numpy as np

from ..ir import Schedule, columns

_F, _B, _I, _W, _SEND_F, _RECV_F, _SEND_B, _RECV_B, _SYNC, _STEP = range(10)  # the codes of _columns.KINDS

#: per rank, one int per batch: the batches before each compute action, then the one after the last
Certificate = Sequence[Sequence[int]]


def proves_valid(schedule: Schedule, certificate: Certificate) -> bool:  # noqa: C901 - one check after another
    """True only when every check of the validator holds for ``schedule``, progress by ``certificate``.

    False means "not proved here" (a problem, a certificate that does not fit, or
    a form this path does not handle: compute-only, forward-only, one rank), not
    "invalid": the caller then runs the full scan.
    """
    sch = schedule
    if sch.meta.get("forward_only") or sch.num_ranks < 2:
        return False
    asynchronous = bool(sch.meta.get("asynchronous", False))
    n, m, p = sch.num_stages, sch.num_microbatches, sch.num_ranks
    cols = columns(sch)
    if cols is None or len(certificate) != p or cols.kind.size == 0:
        return False
    kind, stage, mb = cols.kind, cols.stage, cols.microbatch
    total = kind.size
    rank = cols.rank
    acting = kind < _SYNC
    mb_acts = mb[acting]
    n_actions = mb_acts.size

    # placement and ranges
    if stage.min() < 0 or stage.max() >= n:
        return False
    plc = np.asarray(sch.placement, np.int64)
    if not np.array_equal(plc[stage], rank):
        return False
    if n_actions and (mb_acts.min() < 0 or mb_acts.max() >= m):
        return False

    # the same positions the scan walks: global index (actions of one rank are contiguous and in order)
    pos = np.arange(total, dtype=np.int64)
    key = stage * m + mb
    nm = n * m
    sel = [kind == c for c in range(10)]
    keys = [key[s] for s in sel]
    where = [pos[s] for s in sel]

    def once(c: int) -> np.ndarray | None:
        """Each key of kind c at most once: the positions by key (-1 where absent), or None on a repeat."""
        counts = np.bincount(keys[c], minlength=nm)
        if counts.size and counts.max() > 1:
            return None
        at = np.full(nm, -1, np.int64)
        at[keys[c]] = where[c]
        return at

    # completeness: one F each; one B, or one I and one W
    if keys[_F].size != nm:
        return False
    pos_f = once(_F)
    pos_b, pos_i, pos_w = once(_B), once(_I), once(_W)
    if pos_f is None or pos_b is None or pos_i is None or pos_w is None:
        return False
    has_b, has_i, has_w = pos_b >= 0, pos_i >= 0, pos_w >= 0
    if not np.all((has_b & ~has_i & ~has_w) | (~has_b & has_i & has_w)):
        return False
    pos_bi = np.where(has_b, pos_b, pos_i)  # the backward that makes the input gradient
    pos_done = np.where(has_b, pos_b, pos_w)  # the backward that finishes the weight gradient

    # local order: backward after its forward, W after its I
    if not (np.all(pos_f[keys[_B]] < where[_B]) and np.all(pos_f[keys[_I]] < where[_I])):
        return False
    if not np.all(pos_i[keys[_W]] < where[_W]):
        return False

    # which stages take their input / output gradient from another rank
    s_idx = np.arange(n)
    f_cross = np.zeros(n, bool)  # input from another rank
    f_cross[1:] = plc[1:] != plc[:-1]
    b_cross = np.zeros(n, bool)  # output gradient from another rank
    b_cross[:-1] = plc[:-1] != plc[1:]
    first_f = s_idx == 0
    last_b = s_idx == n - 1

    # communication: each op only where a value crosses, once each, all of them
    for c, cross in ((_SEND_F, b_cross), (_RECV_F, f_cross), (_SEND_B, f_cross), (_RECV_B, b_cross)):
        st = keys[c] // m
        if not np.all(cross[st]) or keys[c].size != m * int(cross.sum()):
            return False
    pos_sf, pos_rf, pos_sb, pos_rb = once(_SEND_F), once(_RECV_F), once(_SEND_B), once(_RECV_B)
    if pos_sf is None or pos_rf is None or pos_sb is None or pos_rb is None:
        return False
    # sends after what they send; receives before what uses them (both exist for every crossing value)
    if not (np.all(pos_f[keys[_SEND_F]] < where[_SEND_F]) and np.all(pos_bi[keys[_SEND_B]] < where[_SEND_B])):
        return False

    # data order on each rank: F needs its input, B / I its output gradient
    kf = keys[_F]
    sf = kf // m
    remote = f_cross[sf]
    local = ~remote & ~first_f[sf]
    if not np.all(pos_rf[kf[remote]] < where[_F][remote]):
        return False
    if not np.all(pos_f[kf[local] - m] < where[_F][local]):
        return False
    kbk = np.concatenate((keys[_B], keys[_I]))
    wbk = np.concatenate((where[_B], where[_I]))
    sbk = kbk // m
    remote = b_cross[sbk]
    local = ~remote & ~last_b[sbk]
    if not np.all(pos_rb[kbk[remote]] < wbk[remote]):
        return False
    if not np.all(pos_bi[kbk[local] + m] < wbk[local]):
        return False

    # channel order: message ids and (sender, receiver) per op; on each channel the same sequence
    send_msg = np.concatenate((2 * keys[_SEND_F], 2 * keys[_SEND_B] + 1))
    send_at = np.concatenate((where[_SEND_F], where[_SEND_B]))
    recv_msg = np.concatenate((2 * (keys[_RECV_F] - m), 2 * (keys[_RECV_B] + m) + 1))
    recv_at = np.concatenate((where[_RECV_F], where[_RECV_B]))
    order = np.argsort(send_at, kind="stable")
    send_msg, send_at = send_msg[order], send_at[order]
    order = np.argsort(recv_at, kind="stable")
    recv_msg, recv_at = recv_msg[order], recv_at[order]
    if send_msg.size != recv_msg.size:
        return False
    msg_stage = send_msg // (2 * m)
    to = np.where(send_msg % 2 == 0, msg_stage + 1, msg_stage - 1)  # the stage the message goes to
    send_chan = rank[send_at] * p + plc[np.clip(to, 0, n - 1)]
    msg_stage = recv_msg // (2 * m)
    frm = msg_stage
    recv_chan = plc[frm] * p + rank[recv_at]
    order_s = np.argsort(send_chan, kind="stable")
    order_r = np.argsort(recv_chan, kind="stable")
    if not (
        np.array_equal(send_chan[order_s], recv_chan[order_r]) and np.array_equal(send_msg[order_s], recv_msg[order_r])
    ):
        return False

    # optimizer steps (few actions: one by one, as the scan does)
    if not asynchronous and not _steps_hold(kind, stage, pos, pos_done, n, m):
        return False

    # progress by certificate
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
    """SYNC never after its stage's STEP; each STEP after all its stage's backward, once; all stages or none."""
    per_stage = np.nonzero(kind >= _SYNC)[0]
    stepped: dict[int, int] = {}
    for at in per_stage.tolist():
        s = int(stage[at])
        if kind[at] == _SYNC:
            if s in stepped:
                return False
        else:
            if s in stepped or int(pos_done[s * m : (s + 1) * m].max()) > at:
                return False
            stepped[s] = at
    return not stepped or len(stepped) == n
