"""Simulate a candidate that fits memory and turn it into a :class:`~stagewise.Plan`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from ..ir import Kind
from ..simulation import CostModel, SimResult, shared_makespan, simulate, tied_done
from .candidate import Candidate
from .comm import pipeline_nodes
from .orders import backward_counts, compute_schedule, placement_of
from .result import Plan, RankMemory


def simulate_candidate(c: Candidate, link_cpu: float = 0.0) -> tuple[SimResult, float, list[float]]:
    """Simulate; return the result, the step time with the asynchronous all-reduces, and each rank's end.
    ``link_cpu``: kept in the result's cost model for the shared-core replay (the plain simulation leaves it out)."""
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
        backward_full=c.costs.backward_times(),
        link_cpu=link_cpu,
    )
    local = c.layout.local
    if c.layout.nodes and local is not None:  # boundaries inside a node on the intra-node link
        model = replace(model, rank_nodes=c.layout.nodes, local_latency=local.latency, local_bandwidth=local.bandwidth)
    sim = simulate(schedule, model)
    ends = ends_with_async_sync(sim, c)
    return sim, max(ends), ends


def ends_with_async_sync(sim: SimResult, c: Candidate) -> list[float]:
    """Each rank's end with each stage's asynchronous all-reduce started at its SYNC, from the first start; and
    with each of the tied layers' gradient sums (:attr:`Candidate.tied`) done as
    :func:`stagewise.simulation.shared_makespan` has its ``tied`` done (:func:`~stagewise.simulation.tied_done`),
    waited for by every rank holding one of its stages."""
    begin = min(times[0] for times in sim.starts if times)
    ends = []
    for acts, rank_ends in zip(sim.actions, sim.ends):
        comm_free = 0.0
        for a, end in zip(acts, rank_ends):
            if a.kind is Kind.SYNC and c.sync_async[a.stage] > 0:
                comm_free = max(comm_free, end) + c.sync_async[a.stage]
        ends.append(max(rank_ends[-1] if rank_ends else 0.0, comm_free) - begin)
    placement = placement_of(c.schedule, c.layout.config.pp, c.v)
    for (stages, _), done in zip(c.tied, tied_done(sim, c.tied)):
        for r in {placement[s] for s in stages}:
            ends[r] = max(ends[r], done - begin)
    return ends


def sharing(pp: int, processes: int, per_node: int) -> tuple[list[float], list[int]]:
    """Per pipeline rank: how many of its node's processes compute with it, and which node that is.

    Ranks are packed onto nodes in order, pp outermost, so pipeline rank ``r`` is global ranks
    ``r * g .. (r + 1) * g - 1`` with ``g = processes / pp`` (its replicas): they share a node with the
    neighbouring pipeline ranks when ``g < per_node``, or fill nodes of their own.
    """
    return [float(min(processes // pp, per_node))] * pp, pipeline_nodes(pp, processes, per_node)


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
    c: Candidate,
    memory: list[RankMemory],
    processes: int,
    per_node: int,
    cores: float | None,
    fixed: float = 0.0,
    hidden: Sequence[float] = (),
    background: float = 0.0,
    link_cpu: float = 0.0,
) -> Plan:
    """Simulate a candidate that fits memory into a plan (its step at least the CPU bound, the cores shared when
    processes outnumber them or a message between nodes takes CPU, plus ``fixed`` seconds per step; see
    :mod:`stagewise.planning.costing`).

    ``hidden``: per pipeline rank, CPU seconds per step each of its processes spends beyond its compute actions
    (transport threads, bookkeeping); on shared cores it is charged with the compute, spread over the rank's
    actions in proportion to their length. ``background``: CPU seconds per second each process spends idle (its
    transport threads), which leaves the node's processes ``cores - per_node * background`` cores for their work.
    ``link_cpu``: the share of a core each message between nodes takes at each end while on the link
    (:attr:`~stagewise.planning.Calibration.link_cpu`): a pipeline that crosses nodes is then replayed on the
    nodes' cores (:func:`~stagewise.simulation.shared_makespan`) even where each process has a core of its own.
    """
    config = c.layout.config
    sim, simulated, _ = simulate_candidate(c, link_cpu)
    placement = placement_of(c.schedule, config.pp, c.v)
    busy = _per_rank(stage_compute(c), placement, config.pp)
    tp_comm = _per_rank([c.m * x for x in c.costs.tp_comm], placement, config.pp)
    busiest = max(range(config.pp), key=lambda r: busy[r])
    extra = list(hidden) if hidden else [0.0] * config.pp
    if len(extra) != config.pp or not all(x >= 0 for x in extra):
        raise ValueError(f"evaluate: hidden needs one CPU time >= 0 per pipeline rank ({config.pp}), got {extra}")
    cpu, shared = _on_shared_cores(
        c, sim, simulated, placement, busy, extra, processes=processes, per_node=per_node, cores=cores, bg=background
    )
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
            "hidden_cpu": extra[busiest],
        },
    )


def _on_shared_cores(
    c: Candidate,
    sim: SimResult,
    simulated: float,
    placement: Sequence[int],
    busy: list[float],
    extra: list[float],
    *,
    processes: int,
    per_node: int,
    cores: float | None,
    bg: float,
) -> tuple[float, float]:
    """The CPU bound, and the step replayed on the node's shared cores (0 unless processes outnumber cores, or
    messages between nodes take CPU: ``sim.costs.link_cpu`` and a pipeline across nodes).

    ``busy`` / ``extra``: per pipeline rank, its compute and its hidden CPU seconds; ``bg``: :func:`evaluate`'s
    ``background``.
    """
    pp = c.layout.config.pp
    oversubscribed = cores is not None and cores < per_node
    crossing = sim.costs.link_cpu > 0 and len(set(c.layout.nodes)) > 1
    left = cores
    if oversubscribed:  # what the processes' idle transport threads leave (never below a tenth of the cores)
        assert cores is not None
        left = max(cores - per_node * bg, cores / 10)
        extra = _beside_sync(extra, _per_rank(c.sync_blocking, placement, pp), left / per_node)
    charged = [b + x for b, x in zip(busy, extra)] if oversubscribed else busy
    cpu = cpu_bound(charged, processes, per_node, left)
    if not oversubscribed and not crossing:
        return cpu, 0.0
    # the compute (and its hidden CPU) replayed on the node's shared cores, with the plain simulation's tail (the
    # asynchronous all-reduces and the tied sums after its makespan: ends_with_async_sync, priced once for both);
    # a process per core (cores None: as many as processes) where only the messages' CPU asks for the replay
    if not oversubscribed:
        left = max(float(per_node), float(cores or 0.0))
    assert left is not None
    weights, nodes = sharing(pp, processes, per_node)
    schedule = compute_schedule(c.schedule, pp, c.m, c.v)
    stretch = [charged[r] / busy[r] if busy[r] > 0 else 1.0 for r in range(pp)]
    shared = shared_makespan(schedule, _stretched(sim.costs, placement, stretch), weights, left, nodes)
    return cpu, shared + (simulated - sim.makespan)


def _beside_sync(hidden: Sequence[float], blocking: Sequence[float], share: float) -> list[float]:
    """The hidden CPU left to charge to the compute once a rank's blocking SYNC has taken its part.

    A blocking SYNC (sharding's gathers and reduce-scatters) is CPU work - gloo's copies and sums, FSDP2's
    hooks - whose seconds were measured on the group's shared cores (:meth:`Calibration.sharding_time`), and the
    layout's hidden CPU (:attr:`LayoutCost.cpu`) counts the same work again. While it runs, each of the node's
    processes holds ``share`` = min(1, cores / processes) of a core, so it accounts for up to ``share`` times
    its seconds of the hidden CPU; only the rest stretches the compute. (Charging both put the FSDP2 layouts'
    collectives into the step twice: pp=1 x sharding=4 of the benchmark MLP at 4 processes on 2 cores was
    predicted 0.19 s, with 0.10 s of SYNC and the compute stretched 29-fold by the same collectives' CPU.)
    """
    share = min(1.0, share)
    return [max(0.0, h - b * share) for h, b in zip(hidden, blocking)]


def _stretched(costs: CostModel, placement: Sequence[int], stretch: Sequence[float]) -> CostModel:
    """The cost model with each stage's compute times multiplied by its rank's ``stretch``."""
    if all(x == 1.0 for x in stretch):
        return costs

    def scale(values: Sequence[float]) -> tuple[float, ...]:
        return tuple(v * stretch[placement[s]] for s, v in enumerate(values))

    return replace(
        costs,
        forward=scale(costs.forward),
        backward_input=scale(costs.backward_input),
        backward_weight=scale(costs.backward_weight),
        backward_full=scale(costs.backward_full) if costs.backward_full else (),
    )


def stage_compute(c: Candidate) -> list[float]:
    """Per stage, its compute in one step: m forwards, and each backward as the schedule runs it (B, or I + W)."""
    config = c.layout.config
    whole, split = backward_counts(c.schedule, config.pp, c.m, c.v)
    f, i, w, b = c.costs.forward, c.costs.backward_input, c.costs.backward_weight, c.costs.backward_times()
    return [c.m * f[s] + whole[s] * b[s] + split[s] * (i[s] + w[s]) for s in range(len(f))]


def _per_rank(values: Sequence[float], placement: Sequence[int], p: int) -> list[float]:
    out = [0.0] * p
    for s, r in enumerate(placement):
        out[r] += values[s]
    return out
