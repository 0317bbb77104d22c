"""Zero-bubble schedules: backward split into I (input gradient) and W (weight gradient).

Qi, Wan, Huang, Lin, "Zero Bubble (Almost) Pipeline Parallelism", ICLR 2024
(arXiv:2401.10241, first titled "Zero Bubble Pipeline Parallelism"): ZB-H1 and
ZB-H2 (Sec. 2, Fig. 3) and ZB-V (Sec. 6).

Vocabulary: p ranks, m micro-batches; with uniform costs F = I = W = 1 time unit.
The orders are compute only. The communication pass
(:func:`stagewise.passes.lowering.add_communication`) posts each receive in
the consumer's first batch after its value exists, and the validator's
rendezvous simulation checks every lowered order, so neighbouring ranks may
interleave forwards and input gradients differently, as the paper's warm-ups
do: the orders here are chosen for time and memory, not to suit the lowering.
"""

from __future__ import annotations

import numpy as np

from ..ir import Action, ActionRows, Kind, from_rows
from ..ir import F as _CF
from ..ir import I as _CI
from ..ir import W as _CW
from .rank_order import RankOrder
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
    transfer="2(p-1)c for m <= p, (p-1)c for m >= 2p-1 (c <= F)",
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
    every rank. That order lowers and validates as well, but the W in each
    steady step holds back the input gradients on their way to rank 0: with
    free transfers, p=4 and m=8 take 30 units instead of 27. Here every rank
    alternates I F strictly while it still has forwards, and its W passes
    wait for the drain. The makespan is the optimum max(3m+p-1, 2m+2p-1)
    -- with uniform costs and a synchronous flush no single-stage-per-rank
    schedule does better, so the bubble equals zb-h1's -- but each deferred
    W keeps its weight-gradient activations alive, so the W part of memory
    grows with m. What the deep warm-up buys is slack: a transfer time
    c <= F adds (p-1)c once m >= 2p-1, and with a transfer of one unit
    (p=8, m=32) the bubble is 0.127 against zb-h1's 0.364.
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
    summary="two stages per rank in a V; the paper's warm-up, F I W steady state and drain",
    paper="Qi et al., Zero Bubble (Almost) Pipeline Parallelism, ICLR 2024, Sec. 6 (ZB-V)",
    placement="v",
    virtual_stages=(2,),
    default_virtual_stages=2,
    bubble="(p-1)/(6m+p-1) for 2m >= 3p-1 (F = I = W per stage)",
    memory="min(p, m) (2p stage activations)",
)
def zb_v(p: int, m: int, v: int) -> ActionRows:
    """ZB-V in the paper's order: rank r holds stage r (going down) and stage 2p-1-r (coming back).

    Rank r runs 2(p-r)-1 forwards of its down stage; r pairs (up forward,
    down forward); p-r triples (up F, I, W); then, while forwards remain,
    F I W of the down stage and F I W of the up stage; then a drain of r
    rounds of both input gradients (their W passes wait), p-r rounds of
    (down I, down W), and the W passes left. The warm-up needs 2p-1
    micro-batches; with fewer, the missing ones are left out of the same
    order. p=3, m=5, free transfers (lower case: the down stage, upper
    case: the up stage)::

        rank 0  f0 f1 f2 f3 f4 F0 I0 W0 F1 I1 W1 F2 I2 W2 i0 w0 F3 I3 W3 i1 w1 F4 I4 W4 i2 w2 i3 w3 i4 w4 .  .
        rank 1  .  f0 f1 f2 F0 f3 F1 I0 W0 F2 I1 W1 f4 i0 w0 F3 I2 W2 i1 w1 F4 I3 W3 i2 I4 i3 w2 i4 w3 W4 w4 .
        rank 2  .  .  f0 F0 f1 F1 f2 F2 I0 W0 f3 i0 w0 F3 I1 W1 f4 i1 w1 F4 I2 W2 i2 I3 i3 I4 i4 w2 W3 W4 w3 w4

    Every value is used a few units after it is made, with W passes in
    between, so a transfer time mostly lands in that slack: with a transfer
    of one forward, p=8 and m=32 take 233 units (199 with free transfers).
    An order in which each value is used the moment it is made reaches the
    optimum for every m >= p with free transfers but pays each transfer on
    its critical path (363 units there).

    Makespan with free transfers and F = I = W = 1 (checked by brute force,
    p <= 12): 6m+p-1 once 2m >= 3p-1, the least possible (rank p-1 starts
    at p-1 and has 6m units of work), so the bubble is (p-1)/(6m+p-1);
    max(6m+p-1, 4m+4p-2) for p < m; and 4p+3m-2 + max(0, m - floor(p/2))
    for m <= p. With m <= p no rank reaches the steady state: each runs all
    its forwards before its first down-stage input gradient, and a W right
    after each input gradient would hold the others back on their way to
    rank 0. There rank r's W passes trail its input gradients by r instead
    (ZB-H1's rule, :meth:`RankOrder.trail_weights`): with F = I = W, or I
    heavier than W, that is at least as fast as the paper's order at every
    transfer time from 0 to one forward (tests/core/test_orders_vs_torch.py;
    not when W dominates, see python -m benchmarks.orders_vs_torch --costs
    w-heavy). No rank holds more than 2p stage
    activations = p micro-batches, 1F1B's rank-0 figure.
    """
    return zb_v_order(p, m)


def zb_v_order(p: int, m: int) -> ActionRows:
    """zb-v's orders as columns (dualpipe-v's too, below 2p micro-batches)."""
    return ActionRows(from_rows([_zb_v_rank(p, m, r) for r in range(p)]))


def _zb_v_rank(p: int, m: int, r: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rank r's ZB-V order: the paper's phases for max(m, 2p-1) micro-batches, the missing ones left out."""
    n = max(m, 2 * p - 1)
    down, up = r, 2 * p - 1 - r
    o = RankOrder(m)
    o.forwards(down, 2 * (p - r) - 1)  # warm-up: the down stage fills the V ...
    for _ in range(r):  # ... then the up stage joins in as its inputs come back
        o.add(_CF, up)
        o.add(_CF, down)
    for _ in range(p - r):  # the first input gradients of the up stage, each with its W
        o.add(_CF, up)
        o.add(_CI, up)
        o.add(_CW, up)
    while o.count(_CF, up) < n:  # steady state: F I W on each stage in turn
        if o.count(_CF, down) < n:
            o.add(_CF, down)
        for stage in (down, up):
            if stage == up:
                o.add(_CF, up)
            o.add(_CI, stage)
            o.add(_CW, stage)
    for _ in range(r):  # drain: rank r lets r rounds of W wait, so the input gradients go back first
        o.add(_CI, down)
        o.add(_CI, up)
    for _ in range(p - r):
        o.add(_CI, down)
        o.add(_CW, down)
    for stage in (up, down):
        while o.count(_CW, stage) < n:
            o.add(_CW, stage)
    if m <= p:  # no steady state (see the docstring)
        o.trail_weights(r)
    return o.columns()
