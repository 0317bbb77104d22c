"""Virtual-stage schedules on the loop placement: interleaved 1F1B and breadth-first looping.

Vocabulary: p ranks, v virtual stages per rank, m micro-batches. Stage
s = c*p + r is *chunk* c of rank r = s % p, so every micro-batch loops through
the ranks v times, and a value crosses from rank p-1 back to rank 0 between
two chunks. With uniform costs a stage forward takes one time unit and its
backward two; the drawings write chunk 0 in lower case (f, b), chunk 1 in
upper case (F, B), each letter followed by the micro-batch.

Both schedules reach the same makespan, 3 * max(v*m + p - 1, v*p + m - 1)
units, the least any schedule can take: rank p-1 starts at p-1 at the
earliest and has 3vm units of work, the last stage starts at vp-1 and has 3m,
and the last backward either of them runs still has to go back to stage 0
(two units a stage). Their bubble is therefore (p-1)/(vm+p-1) for m >= p and
(vp-1-(v-1)m)/(vp+m-1) for m <= p. They differ in memory: interleaved 1F1B
holds about p micro-batches of activations per rank, breadth-first all m.

Both build, lower and validate for every p, m and v. On a loop the
communication needs care: posting each receive right before the compute that
uses it deadlocks under blocking, batched point-to-point once a second group
of micro-batches follows the first (values waiting to cross from rank p-1
back to rank 0 block their senders in a ring). :func:`stagewise.passes.lowering.add_communication`
therefore posts each receive in the consumer's first batch after the value is
made (judged by a timing of the schedule), and the validator's rendezvous
simulation checks the result.
"""

from __future__ import annotations

import numpy as np

from ..ir import ActionRows, from_rows
from ..ir import B as _B
from ..ir import F as _F
from .registry import register


def microbatch_groups(p: int, m: int) -> list[int]:
    """Sizes of the groups of micro-batches that go through the chunks together.

    One group of m when m <= p; otherwise floor(m/p) groups of at least p,
    the remainder spread over the first ones (sizes never increase), so that
    a micro-batch's next chunk is never due on rank 0 before it has come
    round the loop.
    """
    if m <= p:
        return [m]
    groups, rest = divmod(m, p)
    return [p + rest // groups + (1 if g < rest % groups else 0) for g in range(groups)]


def chunk_order(groups: list[int], v: int, *, backward: bool) -> list[tuple[int, int]]:
    """(chunk, micro-batch) in the order a rank runs them: group by group, chunk by chunk.

    Forward chunks go 0 .. v-1, backward chunks v-1 .. 0; within a chunk the
    group's micro-batches go in order.
    """
    chunks = range(v - 1, -1, -1) if backward else range(v)
    order: list[tuple[int, int]] = []
    first = 0
    for size in groups:
        order += [(c, i) for c in chunks for i in range(first, first + size)]
        first += size
    return order


def warm_up(p: int, r: int, v: int, deep: bool) -> int:
    """Rank r's warm-up forwards beyond the first group's (v-1)g: 1F1B's p-1-r for v = 1; with v > 1,
    Megatron-LM's 2(p-1-r), the slack that lets a transfer hide behind work, or rank 0's p-1 on every
    rank when the whole step is one group (m <= p: nothing to overlap, activations capped at m)."""
    if v == 1:
        return p - 1 - r
    return p - 1 if deep else 2 * (p - 1 - r)


@register(
    "interleaved-1f1b",
    summary="each rank holds v loop-placed stages; 1F1B over groups of p micro-batches, chunk by chunk",
    paper="Narayanan et al., Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM, "
    "SC 2021, Sec. 2.2.2 (interleaved schedule, Fig. 4)",
    bubble="(p-1)/(vm+p-1) for m >= p, (vp-1-(v-1)m)/(vp+m-1) for m < p",
    memory="min(p, m) for m <= p or v = 1; p + (p-1)/v when p divides m; else ((v-1)g + 2p-1)/v, g the first group",
    virtual_stages=None,
    default_virtual_stages=2,
)
def interleaved_1f1b(p: int, m: int, v: int) -> ActionRows:
    """Megatron-LM's interleaved 1F1B, for any m and v (v = 1 is exactly ``1f1b``).

    The micro-batches go in groups of p (:func:`microbatch_groups`); a rank
    runs a group's forwards chunk by chunk, 0 to v-1, and its backwards chunk
    by chunk, v-1 to 0 (:func:`chunk_order`). Rank r runs (v-1)*g + w(r)
    forwards first (g: the first group's size; w(r) in :func:`warm_up`: 1F1B's
    p-1-r for v = 1, Megatron-LM's 2(p-1-r) for v > 1; for m <= p see below),
    then alternates one forward and one backward, then drains its backwards.
    p=2, m=4, v=2 (f/b: chunk 0, F/B: chunk 1; a backward takes two forwards)::

        rank 0  f0 f1 F0 F1 f2 .  B0 B0 f3 B1 B1 F2 b0 b0 F3 b1 b1 .  B2 B2 .  B3 B3 b2 b2 b3 b3
        rank 1  .  f0 f1 F0 B0 B0 F1 B1 B1 f2 b0 b0 f3 b1 b1 F2 B2 B2 F3 B3 B3 b2 b2 b3 b3 .  .

    Makespan 3(vm+p-1) for m >= p with free transfers: the bubble is 1/v of 1F1B's, for every
    m >= p, not only multiples of p. Rank r holds at most min(vm, (v-1)g + 2(p-1-r) + 1) stage
    activations: p + (p-1)/v micro-batches on rank 0 when p divides m, (p-1)/v more than 1F1B's p.
    Those extra forwards are slack for transfers: with the shallower warm-up p-1-r (1F1B's memory,
    which this generator ran until 2026-11-28) every value is consumed the moment it arrives, so
    every transfer lands on the critical path (p=8, m=32, v=2 with a transfer of one forward: 339
    units against 243 with Megatron's warm-up, ``python -m benchmarks.orders_vs_torch``). With m > p
    this is torch's Interleaved1F1B order.

    Megatron also gives the last group the remainder of m/p; a group smaller
    than p makes rank 0 wait for the loop, so here the remainder joins the
    first groups, which keeps the bubble at 1/v and costs
    (v-1) * ceil((m mod p) / floor(m/p)) extra stage activations.

    For m <= p (one group of m) nothing overlaps across chunks and the
    makespan is 3(vp+m-1), as for v*p stages on v*p ranks. Activations are
    capped at m micro-batches there anyway, so for v > 1 every rank warms up
    as deep as rank 0, (v-1)m + p-1 forwards (all but at most one): no rank
    holds more than rank 0, and the later ranks get slack for transfers (as
    fast as torch's order at m = p, at every transfer time).
    """
    groups = microbatch_groups(p, m)
    f_chunk, f_mb = np.asarray(chunk_order(groups, v, backward=False), np.int64).reshape(-1, 2).T
    b_chunk, b_mb = np.asarray(chunk_order(groups, v, backward=True), np.int64).reshape(-1, 2).T
    total = v * m
    kind = np.zeros(2 * total, np.int64)
    deep = v > 1 and m <= p  # every rank warms up as deep as rank 0 (see the docstring)
    rows = []
    for r in range(p):
        w = min((v - 1) * groups[0] + warm_up(p, r, v, deep), total)
        # positions in the rank's order: w forwards, then F B pairs, then the last w backwards
        steady = w + 2 * np.arange(total - w, dtype=np.int64)
        at_f = np.concatenate([np.arange(w, dtype=np.int64), steady])
        at_b = np.concatenate([steady + 1, w + 2 * (total - w) + np.arange(w, dtype=np.int64)])
        kind[at_f], kind[at_b] = _F, _B
        stage, mb = np.empty(2 * total, np.int64), np.empty(2 * total, np.int64)
        stage[at_f], stage[at_b] = f_chunk * p + r, b_chunk * p + r
        mb[at_f], mb[at_b] = f_mb, b_mb
        rows.append((kind.copy(), stage, mb))
    return ActionRows(from_rows(rows))


@register(
    "looped-bfs",
    summary="each rank runs all m forwards of one local stage before the next, then backwards in reverse",
    paper="Lamy-Poirier, Breadth-First Pipeline Parallelism, MLSys 2023",
    bubble="(p-1)/(vm+p-1) for m >= p, (vp-1-(v-1)m)/(vp+m-1) for m < p",
    memory="m",
    transfer="2(vp-1)c for m <= p, 2(p-1)c for m >= 2p (c <= F)",
    virtual_stages=None,
    default_virtual_stages=2,
)
def looped_bfs(p: int, m: int, v: int) -> ActionRows:
    """Breadth-first looping: stage by stage, all micro-batches at once (v = 1 is exactly ``gpipe``).

    Rank r runs the forwards of stage r for micro-batches 0 .. m-1, then of
    stage r+p, ..., then the backwards of its last stage, ..., of stage r.
    p=2, m=3, v=2::

        rank 0  f0 f1 f2 F0 F1 F2 .  .  .  B0 B0 B1 B1 B2 B2 b0 b0 b1 b1 b2 b2
        rank 1  .  f0 f1 f2 F0 F1 F2 B0 B0 B1 B1 B2 B2 b0 b0 b1 b1 b2 b2 .  .

    Same makespan as interleaved 1F1B, 3 * max(vm+p-1, vp+m-1), but every
    rank holds all v*m stage activations (m micro-batches) at the turn. The
    paper pairs it with sharded data parallelism: a stage's gradients are
    final, and can be reduced, while the rank still works on its other
    stages.
    """
    chunk = np.concatenate([np.repeat(np.arange(v, dtype=np.int64), m), np.repeat(np.arange(v - 1, -1, -1), m)])
    kind = np.repeat(np.array([_F, _B], np.int64), v * m)
    mb = np.tile(np.arange(m, dtype=np.int64), 2 * v)
    return ActionRows(from_rows([(kind, chunk * p + r, mb) for r in range(p)]))
