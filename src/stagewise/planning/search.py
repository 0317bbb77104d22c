"""The search: every layout, schedule, virtual-stage count, micro-batch count and recompute choice, best first.

For each factorisation ``pp x dp x sharding x tp`` of the processes, each
registered synchronous schedule and virtual-stage count, each micro-batch
count dividing the per-replica batch and each recompute choice, the exact
partitioner (:func:`stagewise.partition.cut.partition_costs`) cuts the layers
(balancing F + B per layer, with the ranks' speeds and their memory for
parameters, gradients and optimizer state), the simulator times one step and
tracks activations, and the collectives are added from
:mod:`stagewise.planning.comm`, the gradient sum of layers tied across
stages (``LayerProfile.tied``) from :mod:`stagewise.planning.tied_sum`.

A candidate whose activations overflow a rank is cut once more with each
layer's activations counted (times the most micro-batches a stage holds), so a
rank short of memory gets fewer layers (:meth:`_Search.memory_cut`).

Pruning: each candidate first gets a *lower bound* on its step time that
holds for every schedule (see :func:`rank_terms`); candidates are taken in
bound order and simulation stops once the bound reaches the ``top``-th best
step time found. A candidate whose parameters, gradients and optimizer state
(or one micro-batch of activations) already exceed a rank's memory is dropped
before it is simulated.

The costs of one candidate are in :mod:`.candidate` (memory, collectives, bounds) and
:mod:`.predict` (the simulation).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..ir import boundary_crossings
from ..parallel import ParallelConfig
from ..partition import partition_costs
from ..schedules import schedule_info
from .auto import synthesized_plans
from .candidate import Candidate, memory_of, over_cap, rank_terms, static_memory, sync_costs, tied_costs
from .costing import partition_weights, stage_base
from .inputs import Problem
from .layouts import Layout, divisors, enumerate_layouts, schedule_options
from .orders import activation_states, placement_of, splits_backward
from .partitions import Partitions
from .predict import evaluate
from .ranking import NOISE, ranked, with_reasons
from .result import Dropped, Plan, PlanSearch, RankMemory, describe, gib


@dataclass(frozen=True)
class _Group:
    """The candidates that share a layout, schedule, v and recompute choice (and so a partition); m varies."""

    layout: Layout
    schedule: str
    v: int
    recompute: str | None


def _per_rank_units(c: Candidate) -> list[int]:
    """Layers with parameters on each pipeline rank (what per-unit costs of a layout scale with)."""
    out = [0] * c.layout.config.pp
    for s, r in enumerate(placement_of(c.schedule, c.layout.config.pp, c.v)):
        out[r] += c.costs.units[s] if c.costs.units else 0
    return out


def _group_bound(prob: Problem, parts: Partitions, g: _Group) -> float:
    """A bound for every m of the group, before partitioning: the busiest rank does at least its share.

    Each pp rank computes ``per_replica / profile_batch`` samples' worth of its layers at its speed, so
    the step is at least all layers' work over the summed speeds, and at least the costliest layer's
    work on the fastest rank (the parts of the work that do not shrink with the batch are left out).
    """
    arrays = parts.layer_arrays(g.layout.config.tp)
    backward = arrays.backward or tuple(i + w for i, w in zip(arrays.backward_input, arrays.backward_weight))
    work = [  # each backward at the cheaper of B and I + W: the bound holds whichever the schedule runs
        f + min(i + w, b) + (f if g.recompute == "stage" else 0.0)
        for f, i, w, b in zip(arrays.forward, arrays.backward_input, arrays.backward_weight, backward)
    ]
    samples = g.layout.per_replica / prob.profile_batch
    return samples * max(sum(work) / sum(g.layout.speeds), max(work) / max(g.layout.speeds))


class _Search:
    """Best first: groups by their bound, expanded into candidates by theirs, simulated until no bound can win."""

    def __init__(self, prob: Problem) -> None:
        self.prob = prob
        self.parts = Partitions(prob)
        self.dropped: list[Dropped] = []
        self.smallest: tuple[float, str, RankMemory] | None = None  # (peak / cap, what, memory) of the closest miss
        self.queue: list[tuple[float, int, Any]] = []  # a _Group, or (group, m, bounds, base, sync costs)
        self.counter = 0
        self.expanded = 0

    def push(self, bound: float, item: Any) -> None:
        self.counter += 1
        heapq.heappush(self.queue, (bound, self.counter, item))

    def miss(self, what: str, memory: Sequence[RankMemory], exact: bool, cand: Candidate) -> None:
        """Keep the reason, and the memory of the candidate closest to fitting (for the error message)."""
        worst = max(memory, key=lambda mem: mem.total / mem.cap)
        if self.smallest is None or worst.total / worst.cap < self.smallest[0]:
            if not exact:
                worst = max(memory_of(cand, self.prob), key=lambda mem: mem.total / mem.cap)
            self.smallest = (worst.total / worst.cap, what, worst)
        r = next(r for r, mem in enumerate(memory) if mem.total > mem.cap)
        tail = "" if exact else " already with one micro-batch in flight"
        self.dropped.append(Dropped(what, over_cap(r, memory[r]) + tail))

    def expand(self, g: _Group) -> None:
        """Partition the group's layers and push each micro-batch count that can run, with its bound.

        Every per-rank term of the bound is affine in the micro-batch size (the costs are), so the
        terms are worked out at sizes 0 and 1 once and each micro-batch count costs O(ranks).
        """
        prob, config = self.prob, g.layout.config
        self.expanded += 1
        info = schedule_info(g.schedule)
        placement = placement_of(g.schedule, config.pp, g.v)
        splits = splits_backward(g.schedule)
        got = self.parts.get(g.layout, placement, g.v, g.recompute)
        if isinstance(got, str):
            self.dropped.append(
                Dropped(describe(config, g.schedule, g.v, 0, g.recompute).replace("m=0", "every m"), got)
            )
            return
        bounds, base = got
        hooks = prob.calibration.hooks_for(config.sharding)
        at0, at1 = base.at(0.0, hooks), base.at(1.0, hooks)
        blocking, background = sync_costs(g.layout, at1, prob.calibration)
        link = g.layout.links["pp"]
        t0 = rank_terms(at0, placement, splits, link, blocking, background)
        t1 = rank_terms(at1, placement, splits, link, blocking, background)
        slopes = [tuple(y - x for x, y in zip(a, b)) for a, b in zip(t0, t1)]
        static = static_memory(
            Candidate(g.layout, g.schedule, g.v, 1, g.recompute, bounds, at1, blocking, background, 1), prob
        )
        act_floor = [0.0] * config.pp  # activation bytes a rank reaches at least, per unit of micro-batch size
        for s, r in enumerate(placement):
            one = at1.activation[s] + (at1.full_activation[s] if g.recompute == "stage" else 0.0)
            act_floor[r] = max(act_floor[r], one)
        for m in divisors(g.layout.per_replica):
            what = describe(config, g.schedule, g.v, m, g.recompute)
            try:
                info.check(config.pp, m, g.v)
            except ValueError as err:
                self.dropped.append(Dropped(what, str(err)))
                continue
            size = g.layout.per_replica // m
            sigma = size / prob.profile_batch
            floor = [
                RankMemory(x.parameters, x.gradients, x.optimizer, sigma * act_floor[r], x.cap)
                for r, x in enumerate(static)
            ]
            if any(mem.total > mem.cap for mem in floor):
                costs = base.at(sigma, hooks)
                cand = Candidate(g.layout, g.schedule, g.v, m, g.recompute, bounds, costs, blocking, background, size)
                if self.memory_cut(g, cand):
                    continue
                cand = Candidate(g.layout, g.schedule, g.v, m, g.recompute, bounds, costs, blocking, background, size)
                self.miss(what, floor, False, cand)
                continue
            bound = 0.0
            for (pre, post, work, fi, sync), (dpre, dpost, dwork, dfi, _) in zip(t0, slopes):
                pre_s = pre + sigma * dpre
                rest = max(m * (work + sigma * dwork) + sync, m * (fi + sigma * dfi) + post + sigma * dpost)
                bound = max(bound, pre_s + rest)
            self.push(bound, (g, m, bounds, base, blocking, background, False))

    def memory_cut(self, g: _Group, cand: Candidate) -> bool:
        """Cut again so that activations count too; push the new candidate and say whether there is one.

        The first cut balances time under the static memory (parameters, gradients, optimizer
        state). When activations then overflow a rank, each layer's memory becomes its static
        bytes plus its activations times the most micro-batches any stage holds at once (as the
        runtime's memory partition does: conservative for ranks that hold fewer), and the exact
        partitioner cuts again under the ranks' caps; the result is checked exactly when popped.
        """
        prob, config = self.prob, g.layout.config
        if g.recompute is not None:
            return False
        states = activation_states(g.schedule, config.pp, cand.m, g.v)
        held = max((f + w for rank in states for _, full, kept in rank for f, w in zip(full, kept)), default=1)
        arrays = self.parts.layer_arrays(config.tp)
        sigma = cand.microbatch_size / prob.profile_batch
        per_byte = 2 + prob.optimizer_state / config.sharding
        memory = [par * per_byte + held * act * sigma for par, act in zip(arrays.parameters, arrays.activation)]
        placement = placement_of(g.schedule, config.pp, g.v)
        caps = [g.layout.caps[r] / g.v for r in placement]
        tp_link = g.layout.links["tp"]
        weights = partition_weights(
            arrays, tp=config.tp, tp_link=tp_link, recompute=None, overhead=prob.overhead,
            backward_overhead=prob.backward_overhead,
        )  # fmt: skip
        speeds = [g.layout.speeds[r] for r in placement]
        if sum(memory) > sum(caps) or max(memory) > max(caps):
            return False  # no cut can fit
        try:
            part = partition_costs(weights, len(placement), speeds=speeds, memory=memory, memory_caps=caps)
        except ValueError:
            return False
        if part.bounds == cand.bounds:
            return False
        base = stage_base(
            arrays,
            part.bounds,
            tp=config.tp,
            tp_link=tp_link,
            recompute=None,
            overhead=prob.overhead,
            action_overhead=prob.action_overhead,
            message=prob.message,
            factor=prob.compute_scale,
            backward_overhead=prob.backward_overhead,
            crossing=boundary_crossings(placement),
        )
        costs = base.at(sigma, prob.calibration.hooks_for(config.sharding))
        blocking, background = sync_costs(g.layout, costs, prob.calibration)
        link = g.layout.links["pp"]
        terms = rank_terms(costs, placement, splits_backward(g.schedule), link, blocking, background)
        bound = max(pre + max(cand.m * work + sync, cand.m * fi + post) for pre, post, work, fi, sync in terms)
        self.push(bound, (g, cand.m, part.bounds, base, blocking, background, True))
        return True

    def run(self, layouts: list[Layout], synthesize: bool = False) -> PlanSearch:
        """Best first until no bound can win; with ``synthesize``, the top plans again with ``"auto"`` schedules.

        With ``best_per_layout`` a layout's candidates stop once none can beat its best plan, and the search
        stops once no bound can enter the ``top`` layouts' best plans.
        """
        prob = self.prob
        candidates = 0
        for layout in layouts:
            for name, v in schedule_options(prob, layout.config.pp):
                for recompute in prob.recompute:
                    g = _Group(layout, name, v, recompute)
                    candidates += len(divisors(layout.per_replica))
                    self.push(_group_bound(prob, self.parts, g), g)
        bar = _Bar(prob.top, prob.best_per_layout)
        kept: list[tuple[Plan, Candidate]] = []  # (plan, its candidate), for the synthesized plans
        while self.queue:
            bound, _, item = self.queue[0]
            if bound >= bar.level * (1 + NOISE):  # plans tied with the top ones (ranking.NOISE) may win on memory
                break
            heapq.heappop(self.queue)
            group = item if isinstance(item, _Group) else item[0]
            if not bar.may_win(group.layout.config, bound):
                continue
            if isinstance(item, _Group):
                self.expand(item)
                continue
            found = self.evaluate(item)
            if found is not None:
                kept.append(found)
                bar.add(found[0])
        plans = [plan for plan, _ in kept]
        if synthesize and plans:
            plans += synthesized_plans(prob, kept)
        if not plans:
            raise ValueError(_no_plan_message(prob, self.smallest, self.dropped))
        ranked = with_reasons(bar.ranked(plans))
        return PlanSearch(
            plans=tuple(ranked),
            candidates=candidates,
            groups_expanded=self.expanded,
            simulated=len(kept),
            dropped=tuple(self.dropped),
            layouts=len(layouts),
        )

    def evaluate(self, item: tuple[Any, ...]) -> tuple[Plan, Candidate] | None:
        """Simulate one popped candidate into a plan, or None (it overflows memory: cut again, or dropped)."""
        prob = self.prob
        g, m, bounds, base, blocking, background, recut = item
        size = g.layout.per_replica // m
        costs = base.at(size / prob.profile_batch, prob.calibration.hooks_for(g.layout.config.sharding))
        placement = placement_of(g.schedule, g.layout.config.pp, g.v)
        tied = tied_costs(g.layout, placement, bounds, prob.profile.tied)
        cand = Candidate(g.layout, g.schedule, g.v, m, g.recompute, bounds, costs, blocking, background, size, tied)
        memory = memory_of(cand, prob)
        if any(mem.total > mem.cap for mem in memory):
            if not recut and self.memory_cut(g, cand):
                return None
            self.miss(cand.describe(), memory, True, cand)
            return None
        config = cand.layout.config
        cal, units = prob.calibration, _per_rank_units(cand)
        key = (config.pp, config.dp, config.tp, config.sharding)
        fixed = cal.step_for(*key, max(units), m)
        hidden = [cal.cpu_for(*key, u, m) for u in units]
        plan = evaluate(
            cand, memory, prob.processes, prob.per_node, prob.cores, fixed, hidden, cal.background, cal.link_cpu
        )
        return plan, cand


class _Bar:
    """What a bound must beat: the ``top``-th best step time found, over plans or (``per_layout``) over the
    layouts' best plans; and, per layout, that layout's best."""

    def __init__(self, top: int, per_layout: bool) -> None:
        self.top, self.per_layout = top, per_layout
        self.best: list[float] = []  # max-heap (negated) of the top step times
        self.layouts: dict[ParallelConfig, float] = {}

    @property
    def level(self) -> float:
        return -self.best[0] if len(self.best) >= self.top else math.inf

    def may_win(self, layout: ParallelConfig, bound: float) -> bool:
        """Whether a candidate of ``layout`` bounded by ``bound`` can still enter the result."""
        return not self.per_layout or bound < self.layouts.get(layout, math.inf) * (1 + NOISE)

    def add(self, plan: Plan) -> None:
        if self.per_layout:
            self.layouts[plan.layout] = min(plan.step_time, self.layouts.get(plan.layout, math.inf))
            self.best = [-x for x in heapq.nsmallest(self.top, self.layouts.values())]
            heapq.heapify(self.best)
            return
        heapq.heappush(self.best, -plan.step_time)
        if len(self.best) > self.top:
            heapq.heappop(self.best)

    def ranked(self, plans: list[Plan]) -> list[Plan]:
        """The ``top`` plans best first (``per_layout``: each layout's best, then those best first)."""
        ordered = ranked(plans)  # within the timing noise: tied, by memory
        if self.per_layout:
            firsts: dict[ParallelConfig, Plan] = {}
            for plan in ordered:
                firsts.setdefault(plan.layout, plan)
            ordered = list(firsts.values())
        return ordered[: self.top]


def run_search(prob: Problem, synthesize: bool = False) -> PlanSearch:
    """Enumerate the layouts (or say why none works), then search them best first."""
    why_not: list[str] = []
    found = enumerate_layouts(prob, why_not)
    if not found:
        raise ValueError(
            f"plan: no factorisation pp x dp x sharding x tp of {prob.processes} processes works: "
            + "; ".join(why_not[:8])
            + (f"; ... ({len(why_not)} in all)" if len(why_not) > 8 else "")
        )
    return _Search(prob).run(found, synthesize)


def _no_plan_message(prob: Problem, smallest: tuple[float, str, RankMemory] | None, dropped: Sequence[Dropped]) -> str:
    if smallest is None:
        reasons = sorted({d.reason for d in dropped})
        return f"plan: no candidate can run: {'; '.join(reasons[:5])}"
    _, what, mem = smallest
    return (
        f"plan: no plan fits the memory cap: the smallest predicted peak is {gib(mem.total)} against "
        f"{gib(mem.cap)} ({what}); its largest term is {mem.dominant} (parameters {gib(mem.parameters)}, gradients "
        f"{gib(mem.gradients)}, optimizer state {gib(mem.optimizer)}, activations {gib(mem.activations)})"
    )
