"""Zero-bubble schedules: backward split into I (input gradient) and W (weight gradient).

Qi, Wan, Huang, Lin, "Zero Bubble (Almost) Pipeline Parallelism", ICLR 2024
(arXiv:2401.10241, first titled "Zero Bubble Pipeline Parallelism"): ZB-H1 and
ZB-H2 (Sec. 2, Fig. 3) and ZB-V (Sec. 6).

Vocabulary: p ranks, m micro-batches; with uniform costs F = I = W = 1 time unit.
Every order here is checked against stagewise's communication model: sends are
posted right after the producing compute, receives right before the consuming
one, each batch blocks until every partner has posted (rendezvous), and
point-to-point messages between two ranks match in posting order. That model
shapes two of the schedules (see zb-h2 and zb-v).
"""

from __future__ import annotations

import numpy as np

from ..ir import Action, ActionRows, Kind, from_rows
from ..ir import F as _CF
from ..ir import I as _CI
from ..ir import W as _CW
from .registry import register

F, I, W = Kind.F, Kind.I, Kind.W


@register(
    "zb-h1",
    summary="1F1B with the backward split in I and W; rank r defers r of its W passes into the drain bubble",
    paper="Qi et al., Zero Bubble (Almost) Pipeline Parallelism, ICLR 2024, Sec. 2.1 (ZB-H1, Fig. 3 top)",
    bubble="(p-1)/(3m+p-1) for m >= p, (2p-1-m)/(2m+2p-1) for m < p (F = I = W)",
    memory="min(p, m)",
)
def zb_h1(p: int, m: int, v: int) -> list[list[Action]]:
    """1F1B's warm-up (p - r forwards on rank r), then I/F pairs; W lags r micro-batches behind I.

    Rank r runs its first r steady iterations as I F (no W), then I W F, so
    input gradients travel back to rank 0 without queueing behind W passes,
    and the r deferred W passes fill the drain. p=3, m=4
    (digits: micro-batch of the F/I/W in that time unit; . idle)::

        rank 0  F0 F1 F2 .  .  I0 W0 F3 I1 W1 I2 W2 I3 W3
        rank 1  .  F0 F1 .  I0 F2 I1 W0 F3 I2 W1 I3 W2 W3
        rank 2  .  .  F0 I0 F1 I1 F2 I2 W0 F3 I3 W1 W2 W3

    Makespan with uniform costs: max(3m+p-1, 2m+2p-1). That is the least any
    single-stage-per-rank schedule can reach: rank p-1 cannot start before
    p-1 and has 3m units of work, and its last input gradient ends no
    earlier than 2m+p-1 (after its m forwards and m input gradients), then
    needs p-1 hops back and a W on rank 0. Hence the bubble (p-1)/(3m+p-1)
    for m >= p and (2p-1-m)/(2m+2p-1) for m < p.
    Activations (F until I) peak at min(p-r, m) on rank r, as in 1F1B.
    """
    ranks = []
    for r in range(p):
        warmup = min(p - r, m)
        acts = [Action(r, F, i) for i in range(warmup)]
        done_w = 0
        for j in range(m):
            acts.append(Action(r, I, j))
            if j >= r:
                acts.append(Action(r, W, done_w))
                done_w += 1
            if warmup + j < m:
                acts.append(Action(r, F, warmup + j))
        acts += [Action(r, W, i) for i in range(done_w, m)]
        ranks.append(acts)
    return ranks


@register(
    "zb-h2",
    summary="ZB-H2's deep warm-up (2p-1-2r forwards on rank r), then strict I/F alternation; W passes in the drain",
    paper="Qi et al., Zero Bubble (Almost) Pipeline Parallelism, ICLR 2024, Sec. 2.2 (ZB-H2, Fig. 3 bottom)",
    bubble="(p-1)/(3m+p-1) for m >= p, (2p-1-m)/(2m+2p-1) for m < p (F = I = W); each rank's own work is gap-free",
    memory="min(2p-1, m) until I, plus the deferred W passes",
)
def zb_h2(p: int, m: int, v: int) -> list[list[Action]]:
    """Rank r runs min(m, 2p-1-2r) warm-up forwards, then I F I F ..., then I W pairs, then the rest of W.

    The extra warm-up fills the bubble before the first I, so once
    m >= 2p-1 every rank works without a gap from its first action to its
    last (the idle time is only the fill: r units before rank r starts,
    p-1-r after it ends). p=3, m=6::

        rank 0  F0 F1 F2 F3 F4 I0 F5 I1 W0 I2 W1 I3 W2 I4 W3 I5 W4 W5 .  .
        rank 1  .  F0 F1 F2 I0 F3 I1 F4 I2 F5 I3 W0 I4 W1 I5 W2 W3 W4 W5 .
        rank 2  .  .  F0 I0 F1 I1 F2 I2 F3 I3 F4 I4 F5 I5 W0 W1 W2 W3 W4 W5

    How it differs from the paper: there, the steady state runs F I W on
    every rank. Under rendezvous point-to-point that order deadlocks: rank
    r holds two more micro-batches than rank r+1, so each forward rank r
    sends crosses two input gradients coming back, and each crossing must
    be posted in one batch on one side (F directly followed by I on rank r,
    or I directly followed by F on rank r+1). Every middle rank must
    therefore alternate I F strictly while it still has forwards, and its W
    passes wait for the drain. The makespan is still the optimum
    max(3m+p-1, 2m+2p-1) -- with uniform costs and a synchronous flush no
    single-stage-per-rank schedule does better, so the bubble equals
    zb-h1's -- but each deferred W keeps its weight-gradient activations
    alive, so the W part of memory grows with m. What the deep warm-up buys
    is slack: with a transfer time of one unit (p=8, m=32) the bubble is
    0.127 against zb-h1's 0.364.
    """
    ranks = []
    for r in range(p):
        warmup = min(m, 2 * p - 1 - 2 * r)
        acts = [Action(r, F, i) for i in range(warmup)]
        done_w = 0
        for j in range(m):
            acts.append(Action(r, I, j))
            if warmup + j < m:
                acts.append(Action(r, F, warmup + j))
            else:
                acts.append(Action(r, W, done_w))
                done_w += 1
        acts += [Action(r, W, i) for i in range(done_w, m)]
        ranks.append(acts)
    return ranks


@register(
    "zb-v",
    summary="two stages per rank in a V; each micro-batch sweeps down and back as one unbroken wave",
    paper="Qi et al., Zero Bubble (Almost) Pipeline Parallelism, ICLR 2024, Sec. 6 (ZB-V)",
    placement="v",
    virtual_stages=(2,),
    default_virtual_stages=2,
    bubble="(p-1)/(6m+p-1) for m >= p (F = I = W per stage)",
    memory="min(p, m) (2p stage activations)",
)
def zb_v(p: int, m: int, v: int) -> ActionRows:
    """ZB-V: rank r holds stage r (going down) and stage 2p-1-r (coming back).

    ``v_wave(p, m, warmup=p-1)``: p-1 micro-batches enter before the first
    input gradient, then each new forward is paired with the input gradient
    of the micro-batch p-1 places earlier; in the steady state every rank
    runs, every six units, one forward and one input gradient of each stage
    and two W. p=3, m=5 (lower case: the rank's stage on the way down, upper
    case: its stage on the way back)::

        rank 0  f0 f1 f2 .  .  F0 I0 F1 W0 F2 f3 i0 I1 w0 W1 F3 f4 i1 I2 w1 I3 F4 I4 i2 W2 i3 W3 i4 W4 w2 w3 w4
        rank 1  .  f0 f1 .  F0 f2 F1 I0 F2 W0 i0 f3 w0 I1 F3 W1 i1 f4 w1 I2 F4 I3 i2 I4 i3 W2 i4 W3 w2 W4 w3 w4
        rank 2  .  .  f0 F0 f1 F1 f2 F2 I0 i0 W0 w0 f3 F3 I1 i1 W1 w1 f4 F4 I2 i2 I3 i3 I4 i4 W2 w2 W3 w3 W4 w4

    Makespan 6m+p-1 for m >= p, the least possible (rank p-1 starts at p-1
    and has 6m units of work), so the bubble is (p-1)/(6m+p-1). No rank
    holds more than 2p stage activations = p micro-batches, 1F1B's rank-0
    figure. For m < p the makespan is at most 4p+4m (the least possible is
    max(6m+p-1, 4p+m): the last micro-batch enters rank 0 at m-1 or later
    and then needs 4p units in a row and a W).

    How it differs from the paper's ZB-V: the warm-up. There rank r runs
    2p-1-r forwards of its first stage before its first input gradient,
    a different count on every rank; since the forwards and the input
    gradients of the V share one link in each direction and point-to-point
    messages match in posting order, neighbours must interleave them the
    same way. Here every rank does: the orders come from a plan in which
    every value is used the moment it is made (see :func:`v_wave`), which
    also rules out rendezvous deadlocks.
    """
    return v_wave(p, m, warmup=p - 1)


# ---- the V wave ---------------------------------------------------------
#
# Stage r (chunk 0) and stage 2p-1-r (chunk 1) live on rank r. Give each of
# the four sweeps of micro-batch k a start time ("origin"): its chunk-0
# forward runs on rank r at origin + r, its chunk-1 input gradient at
# origin + r (both travel down the ranks), its chunk-1 forward and chunk-0
# input gradient at origin + p-1-r (both travel up). In this plan every value
# is used on the next rank exactly when it is made (zero slack), so the order
# of messages on a link is the order they were made, and a rank posting a
# batch finds its partners posting theirs at the same instant: no deadlock.
# Downward sweeps start at even times and upward ones at times of the parity
# of p, so the two never meet on a rank; W fills the remaining time units.
# (The plan only fixes the order; the simulator, starting each action as
# early as it can, may run some warm-up forwards sooner.)

_F0, _I1, _F1, _I0 = range(4)  # chunk-0 forward, chunk-1 input grad (down); chunk-1 forward, chunk-0 input grad (up)


def v_wave(p: int, m: int, warmup: int) -> ActionRows:
    """Per-rank orders of a zero-slack V schedule on ``v_placement(p, 2)``.

    With w = min(warmup, m), the downward sweeps start in the order: the
    chunk-0 forwards of micro-batches 0 .. w-1, then for k = 0, 1, ... the
    chunk-0 forward of w+k followed by the chunk-1 input gradient of k.
    The upward sweeps follow the same pattern with the chunk-1 forwards and
    the chunk-0 input gradients. Each sweep starts at the first time of its
    parity at which its input exists (p units after the sweep it continues
    started); while forwards remain, every backward sweep is followed by one
    time of its parity left to W, so a rank's steady state is 2 F, 2 I and
    2 W every six units.

    Made as integer columns (no action objects: :class:`~stagewise.ir.columns.ActionRows`
    makes a rank's row when asked), so the lowering reads them as they are: at
    128 ranks x 1024 micro-batches the V has ~1.2 M compute actions.
    """
    start = np.asarray(_sweep_starts(p, m, min(warmup, m)), np.int64)
    return ActionRows(from_rows([_rank_columns(p, r, start) for r in range(p)]))


def _sweep_words(m: int, w: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    down = [(_F0, k) for k in range(w)]
    up = [(_F1, k) for k in range(w)]
    for k in range(m):
        if w + k < m:
            down.append((_F0, w + k))
            up.append((_F1, w + k))
        down.append((_I1, k))
        up.append((_I0, k))
    return down, up


def _sweep_starts(p: int, m: int, w: int) -> list[list[int]]:
    """start[sweep][k]: the origin of each sweep of micro-batch k (see the comment above)."""
    down, up = _sweep_words(m, w)
    needs = {_I1: _F1, _F1: _F0, _I0: _I1}  # a sweep may start p units after the one it needs
    start = [[-1] * m for _ in range(4)]
    queues = ((down, 0), (up, p % 2))
    pos = [0, 0]
    rest = [False, False]  # leave the next slot of this parity to W
    t = 0
    while pos[0] < len(down) or pos[1] < len(up):
        for q, (word, parity) in enumerate(queues):
            if t % 2 != parity or pos[q] == len(word):
                continue
            if rest[q]:
                rest[q] = False
                continue
            sweep, k = word[pos[q]]
            if sweep in needs and not 0 <= start[needs[sweep]][k] <= t - p:
                continue
            start[sweep][k] = t
            pos[q] += 1
            # in the steady state (forwards still to come) a backward sweep is followed by a W slot
            rest[q] = sweep in (_I1, _I0) and pos[q] < len(word) and word[pos[q]][0] in (_F0, _F1)
        t += 1
    return start


def _rank_columns(p: int, r: int, start: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rank r's compute order as (kind, stage, micro-batch) columns: the sweeps at their times, W (oldest first)
    in every free unit, the W still owed at the end after them."""
    m = start.shape[1]
    down, up = r, 2 * p - 1 - r
    k = np.arange(m, dtype=np.int64)
    # the four sweeps' actions on this rank, at their times
    times = np.concatenate([start[_F0] + r, start[_I1] + r, start[_F1] + p - 1 - r, start[_I0] + p - 1 - r])
    kinds = np.repeat(np.array([_CF, _CI, _CF, _CI], np.int64), m)
    stages = np.repeat(np.array([down, up, up, down], np.int64), m)
    mbs = np.tile(k, 4)
    size = int(times.max()) + 1
    busy = np.zeros(size, bool)
    busy[times] = True
    if int(busy.sum()) != times.size:  # the plan puts one sweep action in each time unit of a rank
        raise AssertionError(f"v_wave: two sweep actions at one time on rank {r} (p={p}, m={m})")
    # each I makes its W runnable; W queue in the order their I ran, each takes the first free unit after
    # its I and after the W before it (a queue: q_j = j + max_{i<=j}(first_free(o_i) - i))
    owed = np.concatenate([start[_I1] + r, start[_I0] + p - 1 - r])
    w_stage = np.repeat(np.array([up, down], np.int64), m)
    by_time = np.argsort(owed, kind="stable")
    owed, w_stage, w_mb = owed[by_time], w_stage[by_time], np.tile(k, 2)[by_time]
    free = np.flatnonzero(~busy)
    j = np.arange(owed.size, dtype=np.int64)
    q = j + np.maximum.accumulate(np.searchsorted(free, owed, side="right") - j)
    w_time = size + j  # owed past the last unit: after it, oldest first
    fits = q < free.size
    w_time[fits] = free[q[fits]]
    order = np.argsort(np.concatenate([times, w_time]), kind="stable")
    kind = np.concatenate([kinds, np.full(owed.size, _CW, np.int64)])[order]
    stage = np.concatenate([stages, w_stage])[order]
    mb = np.concatenate([mbs, w_mb])[order]
    return kind, stage, mb
