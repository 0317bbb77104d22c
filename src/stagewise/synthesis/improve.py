"""Local moves: shorten the critical path by moving the actions on it, or those that hold its rank.

The makespan is the longest chain of the timed schedule: each action on it started either when its rank
became free (the action before it held the rank) or when its input arrived. Only the first kind can be
helped by reordering one rank: move the waiting action ahead, or move what held the rank behind it (a W
nobody waits for, an F whose consumer is not ready). A move is kept when the schedule still finishes,
every rank keeps its local order (F before I before W of a micro-batch) and fits its caps, and the step
gets shorter; at an equal makespan, when the ranks end earlier in sum (which opens the next move).

The moves are drawn from a seeded generator, so a search is repeatable.
"""

from __future__ import annotations

import random

from .orders import Instance, Orders, fits

_SHIFTS = (1, 1, 2, 3, 5)


def improve(inst: Instance, starts: list[Orders], effort: int, bound: float) -> tuple[Orders, float, int]:
    """Hill-climb from each of ``starts`` (``effort`` evaluations in all); the best orders, makespan, evaluations."""
    best: Orders | None = None
    best_ms = float("inf")
    used = 0
    share = max(1, effort // max(len(starts), 1))
    for k, orders in enumerate(starts):
        got, ms, spent = _climb(inst, orders, share, bound, random.Random(k))
        used += spent
        if ms < best_ms:
            best, best_ms = got, ms
    assert best is not None
    return best, best_ms, used


def _climb(inst: Instance, orders: Orders, budget: int, bound: float, rng: random.Random) -> tuple[Orders, float, int]:
    cur = [list(acts) for acts in orders]
    score = inst.score(cur)
    assert score is not None
    used = 0
    stale = 0
    while used < budget and score[0] > bound * (1 + 1e-12) and stale < budget // 4 + 20:
        moves = _candidate_moves(inst, cur, rng)
        improved = False
        for r, src, dst in moves:
            if used >= budget:
                break
            trial = _moved(cur[r], src, dst)
            if trial is None or not fits(trial, r, inst.problem):
                continue
            old = cur[r]
            cur[r] = trial
            got = inst.score(cur)
            used += 1
            if got is not None and got < score:
                score, improved = got, True
                break
            cur[r] = old
        stale = 0 if improved else stale + 1
        if not moves:
            break
    return cur, score[0], used


def _candidate_moves(inst: Instance, orders: Orders, rng: random.Random) -> list[tuple[int, int, int]]:
    """(rank, from, to) moves around the critical path's rank-bound actions, most promising first, plus a few
    random W shifts (so a plateau is left some way)."""
    moves: list[tuple[int, int, int]] = []
    for r, k in _rank_bound(inst, orders):
        for d in _SHIFTS:
            if k - d >= 0:
                moves.append((r, k, k - d))  # the waiting action ahead
            if k - 1 + d < len(orders[r]):
                moves.append((r, k - 1, k - 1 + d))  # what held the rank, behind
    rng.shuffle(moves)
    for _ in range(4):
        r = rng.randrange(len(orders))
        if orders[r]:
            k = rng.randrange(len(orders[r]))
            d = rng.choice(_SHIFTS) * rng.choice((-1, 1))
            moves.append((r, k, min(max(k + d, 0), len(orders[r]) - 1)))
    return moves


def _rank_bound(inst: Instance, orders: Orders) -> list[tuple[int, int]]:
    """(rank, index) of the actions on the critical path that started when their rank became free."""
    timed = inst.times(orders)
    if timed is None:
        return []
    start, base = timed
    flat = [c for acts in orders for c in acts]
    took, need, make, delay = inst.took, inst.need, inst.make, inst.delay
    producer = {make[c]: g for g, c in enumerate(flat) if make[c] >= 0}
    end = [s + took[c] for s, c in zip(start, flat)]
    g = max(range(len(flat)), key=lambda x: end[x])
    rank_of = [r for r in range(len(orders)) for _ in orders[r]]
    out = []
    eps = 1e-9 * (1 + end[g])
    while True:
        r = rank_of[g]
        k = g - base[r]
        msg = need[flat[g]]
        src = producer.get(msg, -1) if msg >= 0 else -1
        arrival = end[src] + delay[flat[src]] if src >= 0 else -1.0
        if src >= 0 and abs(start[g] - arrival) <= eps:
            g = src
            continue
        if k == 0:
            break
        out.append((r, k))
        g -= 1
    return out


def _moved(acts: list[int], src: int, dst: int) -> list[int] | None:
    """``acts`` with the action at ``src`` moved to ``dst``; None if that breaks F before I before W."""
    if src == dst:
        return None
    out = acts[:src] + acts[src + 1 :]
    out.insert(dst, acts[src])
    code = acts[src]
    lo, hi = min(src, dst), max(src, dst)
    key, kind = divmod(code, 3)
    for other in acts[lo : hi + 1]:
        if other != code and other // 3 == key:
            if (dst < src and other % 3 < kind) or (dst > src and other % 3 > kind):
                return None
    # data order between two stages of one rank (same micro-batch) needs no check here: every such pair is
    # joined by messages, so breaking it leaves the orders unable to finish (the timing returns None)
    return out
