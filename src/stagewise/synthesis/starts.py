"""Where the search starts: every registered schedule that fits, a one-at-a-time order, and greedy play-outs."""

from __future__ import annotations

import math
from collections.abc import Iterator

from ..ir import Schedule
from ..schedules import generate, schedule_info, schedule_names
from .greedy import Policy
from .orders import Instance, Orders, fits, from_schedule
from .problem import Problem


def registered(problem: Problem) -> Iterator[tuple[str, Schedule]]:
    """(name, compute-only schedule) of each registered synchronous schedule on this placement and v."""
    p, m, v = problem.num_ranks, problem.microbatches, problem.virtual_stages
    for name in schedule_names(synchronous=True):
        info = schedule_info(name)
        if info.virtual_stages is not None and v not in info.virtual_stages:
            continue
        if v > 1 and info.placement != problem.placement_kind:
            continue
        schedule = generate(name, p, m, v)
        if tuple(schedule.placement) != problem.placement:
            continue
        yield name, schedule


def hand_written(problem: Problem) -> Iterator[tuple[str, Orders]]:
    """(name, orders) of each registered synchronous schedule on this placement and v (fitting or not), each B
    as I then W (where the search runs a stage whole, that pair is timed as the B)."""
    for name, schedule in registered(problem):
        yield name, from_schedule(schedule, problem.microbatches)


def fitting(problem: Problem, orders: Orders) -> bool:
    return all(fits(acts, r, problem) for r, acts in enumerate(orders))


def one_at_a_time(problem: Problem) -> Orders:
    """Each micro-batch through the whole pipeline before the next enters: fits the least cap there is."""
    m = problem.microbatches
    orders: Orders = []
    for r in range(problem.num_ranks):
        local = problem.stages_of(r)
        acts: list[int] = []
        for i in range(m):
            acts += [3 * (s * m + i) for s in local]
            for s in reversed(local):
                acts += [3 * (s * m + i) + 1, 3 * (s * m + i) + 2]
        orders.append(acts)
    return orders


def admissible_depth(problem: Problem, rank: int) -> int:
    """How many micro-batches rank ``rank``'s caps let it hold at once (at least 1)."""
    depth = problem.microbatches
    local = problem.stages_of(rank)
    for lim in problem.limits:
        one = sum(lim.add[s] for s in local)
        if one > 0 and lim.caps[rank] < math.inf:
            depth = min(depth, int(lim.caps[rank] / one + 1e-9))
    return max(1, depth)


def policies(inst: Instance) -> list[Policy]:
    """The policies to play out: warm-up depths around 1F1B's (p - r) and ZB-H2's (2p - 1 - 2r), constant
    depths, and the memory's own limit, each with every W slack and I / F preference."""
    prob = inst.problem
    p, m = prob.num_ranks, prob.microbatches
    top = [admissible_depth(prob, r) for r in range(p)]
    depths: list[tuple[int, ...]] = []

    def add(values: list[float]) -> None:
        depth = tuple(max(1, min(top[r], m, round(x))) for r, x in enumerate(values))
        if depth not in depths:
            depths.append(depth)

    for a in (1.0, 1.5, 2.0):
        for b in (-1, 0, 1, 2):
            add([a * (p - r) + b for r in range(p)])
    for c in (1, 2, p // 2, p, p + 1, 2 * p):
        add([float(c)] * p)
    add([float(x) for x in top])
    deep = (True, False) if prob.virtual_stages > 1 else (True,)
    return [
        Policy(depth, slack, i_first, d)
        for depth in depths
        for slack in (0.0, 0.5, 1.0, float("inf"))
        for i_first in (True, False)
        for d in deep
    ]
