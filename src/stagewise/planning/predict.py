"""Simulate a candidate that fits memory and turn it into a :class:`~stagewise.Plan`."""

from __future__ import annotations

from collections.abc import Sequence

from ..actions import Kind
from ..costs import CostModel
from ..simulate import SimResult, simulate
from ..simulate_shared import shared_makespan
from .candidate import Candidate
from .orders import compute_schedule, placement_of
from .result import Plan, RankMemory


def simulate_candidate(c: Candidate) -> tuple[SimResult, float, list[float]]:
    """Simulate; return the result, the step time with the asynchronous all-reduces, and each rank's end."""
    config = c.layout.config
    schedule = compute_schedule(c.schedule, config.pp, c.m, c.v)
    link = c.layout.links["pp"]
    n = schedule.num_stages
    model = CostModel(
        num_stages=n,
        forward=c.costs.forward,
        backward_input=c.costs.backward_input,
        backward_weight=c.costs.backward_weight,
        activation_bytes=c.costs.activation,
        weight_activation_bytes=c.costs.keep,
        parameter_bytes=c.costs.parameters,
        output_bytes=c.costs.output,
        latency=link.latency,
        bandwidth=link.bandwidth,
        sync_time=c.sync_blocking,
    )
    sim = simulate(schedule, model)
    begin = min(times[0] for times in sim.starts if times)
    ends = []
    for acts, rank_ends in zip(sim.actions, sim.ends):
        comm_free = 0.0
        for a, end in zip(acts, rank_ends):
            if a.kind is Kind.SYNC and c.sync_async[a.stage] > 0:
                comm_free = max(comm_free, end) + c.sync_async[a.stage]
        ends.append(max(rank_ends[-1] if rank_ends else 0.0, comm_free) - begin)
    return sim, max(ends), ends


def sharing(pp: int, processes: int, per_node: int) -> tuple[list[float], list[int]]:
    """Per pipeline rank: how many of its node's processes compute with it, and which node that is.

    Ranks are packed onto nodes in order, pp outermost, so pipeline rank ``r`` is global ranks
    ``r * g .. (r + 1) * g - 1`` with ``g = processes / pp`` (its replicas): they share a node with the
    neighbouring pipeline ranks when ``g < per_node``, or fill nodes of their own.
    """
    group = processes // pp
    return [float(min(group, per_node))] * pp, [r * group // per_node for r in range(pp)]


def cpu_bound(busy: Sequence[float], processes: int, per_node: int, cores: float | None) -> float:
    """The busiest node's compute over its cores: no step is shorter when processes outnumber cores.

    ``busy`` per pipeline rank (every replica and tp rank of it alike); ranks are packed onto
    nodes in order, pp outermost, so global rank ``g`` computes like pipeline rank
    ``g // (processes / pp)``. 0 when each process has a core (``cores`` None or enough).
    """
    if cores is None or cores >= per_node:
        return 0.0
    group = processes // len(busy)
    worst = 0.0
    for first in range(0, processes, per_node):
        worst = max(worst, sum(busy[g // group] for g in range(first, first + per_node)))
    return worst / cores


def evaluate(
    c: Candidate, memory: list[RankMemory], processes: int, per_node: int, cores: float | None, fixed: float = 0.0
) -> Plan:
    """Simulate a candidate that fits memory into a plan (its step at least the CPU bound, the cores shared when
    processes outnumber them, plus ``fixed`` seconds per step; see :mod:`stagewise.planning.costing`)."""
    config = c.layout.config
    sim, simulated, _ = simulate_candidate(c)
    placement = placement_of(c.schedule, config.pp, c.v)
    busy = [0.0] * config.pp
    tp_comm = [0.0] * config.pp
    for s, r in enumerate(placement):
        busy[r] += c.m * (c.costs.forward[s] + c.costs.backward_input[s] + c.costs.backward_weight[s])
        tp_comm[r] += c.m * c.costs.tp_comm[s]
    busiest = max(range(config.pp), key=lambda r: busy[r])
    cpu = cpu_bound(busy, processes, per_node, cores)
    shared = 0.0
    if cores is not None and cores < per_node:  # the compute replayed on the node's shared cores, same tail
        weights, nodes = sharing(config.pp, processes, per_node)
        schedule = compute_schedule(c.schedule, config.pp, c.m, c.v)
        shared = shared_makespan(schedule, sim.costs, weights, cores, nodes) + simulated - sim.makespan
    step = max(simulated, cpu, shared) + fixed
    return Plan(
        layout=config,
        schedule=c.schedule,
        virtual_stages=c.v,
        microbatches=c.m,
        microbatch_size=c.microbatch_size,
        partition=tuple(b - a for a, b in zip(c.bounds, c.bounds[1:])),
        recompute=c.recompute,
        step_time=step,
        bubble=sim.bubble_ratio,
        memory=tuple(memory),
        costs=sim.costs,
        breakdown={
            "compute": busy[busiest],
            "tp_comm": tp_comm[busiest],
            "grad_sync": simulated - sim.makespan + max(_per_rank(c.sync_blocking, placement, config.pp)),
            "pipeline_idle": sim.bubble_ratio * sim.makespan,
            "simulated": simulated,
            "cpu_bound": cpu,
            "shared_cores": shared,
        },
    )


def _per_rank(values: Sequence[float], placement: Sequence[int], p: int) -> list[float]:
    out = [0.0] * p
    for s, r in enumerate(placement):
        out[r] += values[s]
    return out
