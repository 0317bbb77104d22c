"""A lower bound on the makespan of every valid schedule for a cost model: heads, work, tails per rank.

Each compute action ``a`` has a *head* h(a), the earliest it can start (the longest chain of work and
transfers that must precede it, with every rank free), and a *tail* q(a), the least time that must follow
its end (the longest chain of work and transfers that depends on it). A rank runs its actions one at a
time, so for any set S of them::

    makespan >= min_{a in S} h(a) + sum_{a in S} duration(a) + min_{a in S} q(a)

(the first of S starts no earlier than the smallest head, the last ends after all of S's work, and its
tail still follows). With S = all of a rank's actions this is "the earliest its first action can start,
plus its total work, plus the shortest tail after its last action"; the bound takes the best S of the form
{a : h(a) >= h0, q(a) >= q0} on every rank, which also covers the critical path (|S| = 1). It is the
classical one-machine relaxation of job-shop scheduling (heads and tails; Carlier, "The one-machine
sequencing problem", EJOR 1982), with memory caps relaxed: a cap only removes schedules, so the bound
holds under any cap. Micro-batches are symmetric, so actions of one (stage, kind) share their head and
tail and the search over S costs O((3v)^3) per rank.

With uniform costs F = I = W = 1 and free transfers it is max(3m + p - 1, 2m + 2p - 1) for one stage per
rank: zb-h1's and zb-h2's makespan, which is therefore optimal (tests check this).

A schedule may run a backward whole (B) or split (I, then W); where B costs less than I + W, the bound
times each backward as an input part of ``min(I, B)`` and a weight part of ``min(I + W, B) - min(I, B)``:
both ways of running it contain such a pair (a B's interval holds them, its gradient leaving no earlier),
so any schedule, however it mixes them, is at least as long as one of the relaxed problem.
"""

from __future__ import annotations

from dataclasses import dataclass

from .problem import Problem


@dataclass(frozen=True)
class Bound:
    """The bound, and on which rank and set of actions it is reached (for the report)."""

    value: float
    rank: int
    why: str


def heads_and_tails(problem: Problem) -> tuple[list[list[float]], list[list[float]]]:
    """h[s][kind] and q[s][kind] for kind 0 = F, 1 = I, 2 = W (the same for every micro-batch)."""
    c, plc, n = problem.search_costs, problem.placement, problem.num_stages
    f, bi, bw = relaxed(problem)
    hop = [c.transfer_time(s) if s + 1 < n and plc[s + 1] != plc[s] else 0.0 for s in range(n)]  # s <-> s+1
    head = [[0.0, 0.0, 0.0] for _ in range(n)]
    for s in range(1, n):
        head[s][0] = head[s - 1][0] + f[s - 1] + hop[s - 1]
    head[n - 1][1] = head[n - 1][0] + f[n - 1]
    for s in range(n - 2, -1, -1):
        head[s][1] = max(head[s][0] + f[s], head[s + 1][1] + bi[s + 1] + hop[s])
    for s in range(n):
        head[s][2] = head[s][1] + bi[s]
    tail = [[0.0, 0.0, 0.0] for _ in range(n)]
    tail[0][1] = bw[0]
    for s in range(1, n):
        tail[s][1] = max(bw[s], hop[s - 1] + bi[s - 1] + tail[s - 1][1])
    tail[n - 1][0] = bi[n - 1] + tail[n - 1][1]
    for s in range(n - 2, -1, -1):
        tail[s][0] = max(bi[s] + tail[s][1], hop[s] + f[s + 1] + tail[s + 1][0])
    return head, tail


def relaxed(problem: Problem) -> tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]]:
    """(F, I, W) per stage that no way of running a backward beats: I as ``min(I, B)``, W as the rest of
    ``min(I + W, B)`` (the search's costs: a stage the search runs whole has I = B and W = 0 there)."""
    c = problem.search_costs
    full = c.backward_times()
    i = tuple(min(x, b) for x, b in zip(c.backward_input, full))
    w = tuple(min(x + y, b) - z for x, y, b, z in zip(c.backward_input, c.backward_weight, full, i))
    return c.forward, i, w


def bound_of(problem: Problem) -> Bound:
    """The largest head + work + tail over every rank and every threshold set of its actions."""
    head, tail = heads_and_tails(problem)
    m = problem.microbatches
    durations = relaxed(problem)
    best = Bound(0.0, 0, "no work")
    names = "FIW"
    for r in range(problem.num_ranks):
        groups = [
            (head[s][k], tail[s][k], m * durations[k][s], f"{s}{names[k]}")
            for s in problem.stages_of(r)
            for k in range(3)
        ]
        for h0 in sorted({g[0] for g in groups}):
            for q0 in sorted({g[1] for g in groups}):
                chosen = [g for g in groups if g[0] >= h0 and g[1] >= q0]
                if not chosen:
                    continue
                value = h0 + sum(g[2] for g in chosen) + q0
                if value > best.value:
                    what = " ".join(g[3] for g in chosen)
                    best = Bound(value, r, f"rank {r}: head {h0:g} + work of {what} + tail {q0:g}")
    return best
