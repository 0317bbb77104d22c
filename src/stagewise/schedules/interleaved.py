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

The loop and stagewise's communication model: :func:`stagewise.passes.add_communication`
posts each receive right before the compute that uses it, and the validator
runs the ranks with blocking, batched point-to-point (a batch completes once
every partner has posted). A value that must wait for its consumer blocks its
sender, and on a loop the blocked senders close a ring. For interleaved 1F1B
that happens as soon as a second group of micro-batches follows the first
(m > p), with Megatron-LM's order (Megatron's runtime posts the receives of
the next forward and backward one step ahead) and with every variant tried
(other warm-ups, group sizes and F/B patterns; a search found gap-free valid
orders only for p = 2). On two ranks it fails one check earlier: both
directions of the link carry forwards and gradients, and the two sides post
them in different orders. For breadth-first it happens once rank 0 still runs
first-chunk forwards while the wrapped values of p earlier micro-batches wait
for it (m >= 2p). Those combinations are refused with a ValueError
(``unsupported`` in the registry). The orders themselves are right for every
m: their compute-only schedules validate and time as above, and a lowering
that posts each receive in the consumer's first batch after the value is
made (by a timing of the schedule) lowers them all.
"""

from __future__ import annotations

from ..actions import Action, Kind
from .registry import register

F, B = Kind.F, Kind.B


def _interleaved_unsupported(p: int, m: int, v: int) -> str | None:
    if p > 1 and v > 1 and m > p:
        return (
            f"with v > 1 it takes at most p = {p} micro-batches: beyond one group of p, values waiting to "
            "cross from rank p-1 back to rank 0 block their senders in a ring, and the communication pass "
            "(each receive posted right before its use) deadlocks under blocking point-to-point (on 2 ranks "
            "the two sides already post the link's messages in different orders)"
        )
    return None


def _bfs_unsupported(p: int, m: int, v: int) -> str | None:
    if p > 1 and v > 1 and m >= 2 * p:
        return (
            f"with v > 1 it takes at most 2p-1 = {2 * p - 1} micro-batches: beyond that, values crossing from "
            "rank p-1 back to rank 0 wait while rank 0 still runs its first-chunk forwards, their senders block "
            "in a ring, and the communication pass (each receive posted right before its use) deadlocks"
        )
    return None


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


@register(
    "interleaved-1f1b",
    summary="each rank holds v loop-placed stages; 1F1B over groups of p micro-batches, chunk by chunk "
    "(for now m <= p when v > 1: see the module docstring)",
    paper="Narayanan et al., Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM, "
    "SC 2021, Sec. 2.2.2 (interleaved schedule, Fig. 4)",
    bubble="(p-1)/(vm+p-1) for m >= p, (vp-1-(v-1)m)/(vp+m-1) for m < p",
    memory="min(p, m) when m < p or p divides m, else at most p + (v-1)(p-1)/v",
    virtual_stages=None,
    default_virtual_stages=2,
)
def interleaved_1f1b(p: int, m: int, v: int) -> list[list[Action]]:
    """Megatron-LM's interleaved 1F1B, for any m and v (v = 1 is exactly ``1f1b``).

    The micro-batches go in groups of p (:func:`microbatch_groups`); a rank
    runs a group's forwards chunk by chunk, 0 to v-1, and its backwards chunk
    by chunk, v-1 to 0 (:func:`chunk_order`). Rank r runs (v-1)*g + p-1-r
    forwards first (g: the first group's size), then alternates one forward
    and one backward, then drains its backwards. p=2, m=4, v=2 (the order;
    the registry refuses m > p for now, see the module docstring)::

        rank 0  f0 f1 F0 F1 .  .  B0 B0 f2 B1 B1 f3 b0 b0 F2 b1 b1 F3 B2 B2 .  B3 B3 b2 b2 b3 b3
        rank 1  .  f0 f1 F0 B0 B0 F1 B1 B1 f2 b0 b0 f3 b1 b1 F2 B2 B2 F3 B3 B3 b2 b2 b3 b3 .  .

    Makespan 3(vm+p-1) for m >= p: the bubble is 1/v of 1F1B's, for every
    m >= p, not only multiples of p. Megatron-LM warms up with 2(p-r-1) +
    (v-1)p forwards, because its runtime exchanges a forward's output and a
    backward's gradient in one step after both; with stagewise's per-action
    batches p-1-r + (v-1)g already keeps every rank busy, so rank r holds at
    most min(vm, (v-1)g + p - r) stage activations: exactly p micro-batches
    on rank 0 when p divides m (Megatron: p + (p-1)/v). Megatron also gives
    the last group the remainder of m/p; a group smaller than p makes rank 0
    wait for the loop, so here the remainder joins the first groups, which
    keeps the bubble at 1/v and costs (v-1) * ceil((m mod p) / floor(m/p))
    extra stage activations. For m < p (one group of m) nothing overlaps
    across chunks and the makespan is 3(vp+m-1), as for v*p stages on v*p
    ranks.
    """
    groups = microbatch_groups(p, m)
    forward = chunk_order(groups, v, backward=False)
    backward = chunk_order(groups, v, backward=True)
    total = v * m
    ranks = []
    for r in range(p):
        warmup = min((v - 1) * groups[0] + p - 1 - r, total)
        acts = [Action(c * p + r, F, i) for c, i in forward[:warmup]]
        for k in range(total - warmup):
            (cf, i), (cb, j) = forward[warmup + k], backward[k]
            acts += [Action(cf * p + r, F, i), Action(cb * p + r, B, j)]
        acts += [Action(c * p + r, B, i) for c, i in backward[total - warmup :]]
        ranks.append(acts)
    return ranks


@register(
    "looped-bfs",
    summary="each rank runs all m forwards of one local stage before the next, then backwards in reverse "
    "(for now m <= 2p-1 when v > 1: see the module docstring)",
    paper="Lamy-Poirier, Breadth-First Pipeline Parallelism, MLSys 2023",
    bubble="(p-1)/(vm+p-1) for m >= p, (vp-1-(v-1)m)/(vp+m-1) for m < p",
    memory="m",
    virtual_stages=None,
    default_virtual_stages=2,
)
def looped_bfs(p: int, m: int, v: int) -> list[list[Action]]:
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
    return [
        [Action(c * p + r, F, i) for c in range(v) for i in range(m)]
        + [Action(c * p + r, B, i) for c in range(v - 1, -1, -1) for i in range(m)]
        for r in range(p)
    ]
