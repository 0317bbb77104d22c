"""``schedules=[..., "auto"]``: the best plans again, each with a schedule synthesized for its own stage costs.

The search ranks the registered schedules as usual; then, for each of the ``top`` plans, the synthesizer
(:mod:`stagewise.synthesis`) writes a schedule for that plan's stage costs, links and micro-batch count,
under the activation memory its ranks have left (their cap less parameters, gradients and optimizer state),
starting from the plan's own schedule. When it is faster the plan comes back as ``schedule="auto"``,
carrying the :class:`~stagewise.ir.Schedule` (``Plan.synthesized``) that ``Pipeline.from_plan`` runs.

Left out, and said so here: plans with recompute (their activation peak has a transient term the
synthesizer does not model) and plans whose processes outnumber the cores (their step is a replay on
shared cores of the registered order, which the prediction would have to redo for the new one).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from ..ir import Schedule
from ..schedules import schedule_info
from ..simulation import simulate
from ..synthesis import synthesize
from .candidate import Candidate, static_memory
from .inputs import Problem
from .predict import ends_with_async_sync
from .ranking import rank_key
from .result import Plan, RankMemory


def synthesized_plans(prob: Problem, simulated: Sequence[tuple[Plan, Candidate]]) -> list[Plan]:
    """An ``"auto"`` plan for each of the ``top`` plans where the synthesized schedule is faster."""
    out: list[Plan] = []
    seen: set[tuple[str, tuple[int, ...]]] = set()
    for plan, cand in sorted(simulated, key=lambda pc: rank_key(pc[0]))[: prob.top]:
        if cand.recompute is not None or plan.breakdown.get("shared_cores", 0.0) > 0 or plan.costs is None:
            continue
        static = static_memory(cand, prob)
        budget = [m.cap - m.parameters - m.gradients - m.optimizer for m in static]
        if any(not b > 0 for b in budget):
            continue
        try:
            schedule = synthesize(
                plan.costs,
                cand.layout.config.pp,
                cand.m,
                memory=math.inf,
                memory_bytes=budget,
                virtual_stages=cand.v,
                placement=schedule_info(cand.schedule).placement,
            )
        except ValueError:  # not even one micro-batch at a time fits
            continue
        auto = _as_plan(plan, cand, static, schedule)
        key = (auto.describe(), auto.partition)  # two registered schedules may lead to one synthesized plan
        if auto.step_time < plan.step_time * (1 - 1e-12) and key not in seen:
            seen.add(key)
            out.append(auto)
    return out


def _as_plan(plan: Plan, cand: Candidate, static: list[RankMemory], schedule: Schedule) -> Plan:
    """``plan`` with the synthesized schedule: its simulated step, idle time and activation peaks."""
    assert plan.costs is not None
    sim = simulate(schedule, plan.costs)
    simulated = max(ends_with_async_sync(sim, cand))  # as the search predicts a step
    old = plan.breakdown
    fixed = plan.step_time - max(old["simulated"], old["cpu_bound"], old["shared_cores"])
    memory = tuple(
        RankMemory(m.parameters, m.gradients, m.optimizer, act, m.cap)
        for m, act in zip(static, sim.peak_activation_bytes)
    )
    breakdown = dict(old)
    breakdown.update(
        simulated=simulated,
        pipeline_idle=sim.bubble_ratio * sim.makespan,
        grad_sync=simulated - sim.makespan + _blocking(cand, schedule),
    )
    return replace(
        plan,
        schedule="auto",
        step_time=max(simulated, old["cpu_bound"]) + fixed,
        bubble=sim.bubble_ratio,
        memory=memory,
        breakdown=breakdown,
        synthesized=schedule,
    )


def _blocking(c: Candidate, schedule: Schedule) -> float:
    """The most rank time any rank spends in blocking collectives at SYNC."""
    per_rank = [0.0] * schedule.num_ranks
    for s, r in enumerate(schedule.placement):
        per_rank[r] += c.sync_blocking[s]
    return max(per_rank)
