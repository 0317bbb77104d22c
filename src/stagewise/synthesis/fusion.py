"""Where the backward runs whole (B) rather than split (I, then W): per stage in the search, per micro-batch after.

Splitting lets a stage's input gradient leave before its weight gradients are made, and W fill a bubble later;
but measured, I + W costs more than B (two passes over the graph, W's kernels run apart: 1.04x B for the demo
GPT's layers at 16 samples, 1.2-1.5x for smaller ones). Splitting pays where the bubble W fills is worth more
than that difference, and not elsewhere. The synthesizer decides it at two grains:

* per stage (:func:`stage_sets`): the search plays out every backward split, every stage whose B costs less
  than I + W run whole, and the best hand-written schedule's own choice; then (up to :data:`FLIPS` such
  stages) it flips one stage at a time, timing the best orders so far again, while that shortens the step;
* per micro-batch (:func:`fuse_pairs`): in the orders found, an I directly followed by its own W becomes one B
  wherever the step does not get longer (where B < I + W it often gets shorter).

With B = I + W (a cost model that does not say otherwise) running whole never pays and nothing changes.
"""

from __future__ import annotations

from ..ir import Kind, Schedule
from ..simulation import CostModel
from .orders import Instance, Orders

FLIPS = 16  # the most stages that could run whole for which the search flips each in turn
PAIR_BUDGET = 512  # the most single-pair trials after fusing every adjacent pair at once made the step longer


def could_run_whole(costs: CostModel) -> tuple[int, ...]:
    """The stages whose B costs less than their I + W: only there can running the backward whole pay."""
    full = costs.backward_times()
    return tuple(
        s
        for s, (i, w, b) in enumerate(zip(costs.backward_input, costs.backward_weight, full))
        if b < (i + w) * (1 - 1e-12)
    )


def whole_stages(schedule: Schedule) -> frozenset[int]:
    """The stages whose every backward in ``schedule`` is a B (a registered order's own choice)."""
    split = {a.stage for acts in schedule.ranks for a in acts if a.kind is Kind.I or a.kind is Kind.W}
    whole = {a.stage for acts in schedule.ranks for a in acts if a.kind is Kind.B}
    return frozenset(whole - split)


def stage_sets(costs: CostModel, baseline: frozenset[int]) -> list[frozenset[int]]:
    """The stage sets the search tries first: none whole, every stage where B < I + W whole, the baseline's."""
    sets = [frozenset[int](), frozenset(could_run_whole(costs)), baseline]
    return list(dict.fromkeys(sets))


def fuse_pairs(inst: Instance, orders: Orders, target: float) -> frozenset[int]:
    """The (stage, micro-batch) keys whose directly adjacent I and W become one B: all of them if that does not
    lengthen the step, else each in turn (in key order, stage 0's first, up to :data:`PAIR_BUDGET`) that does not."""
    whole, m = inst.problem.fused, inst.m
    pairs = sorted(
        c // 3
        for acts in orders
        for a, c in zip(acts, acts[1:])
        if a % 3 == 1 and c == a + 1 and (c // 3) // m not in whole
    )
    every = frozenset(pairs)
    ms = inst.with_whole(every).makespan(orders)
    if ms is not None and ms <= target * (1 + 1e-12):
        return every
    chosen: frozenset[int] = frozenset()
    best = target
    for key in pairs[:PAIR_BUDGET]:
        trial = chosen | {key}
        ms = inst.with_whole(trial).makespan(orders)
        if ms is not None and ms <= best * (1 + 1e-12):
            chosen, best = trial, min(best, ms)
    return chosen
