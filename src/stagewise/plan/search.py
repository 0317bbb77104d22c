"""The search: every layout, schedule, virtual-stage count, micro-batch count and recompute choice, best first.

For each factorisation ``pp x dp x sharding x tp`` of the processes, each
registered synchronous schedule and virtual-stage count, each micro-batch
count dividing the per-replica batch and each recompute choice, the exact
partitioner (:func:`stagewise.partition.partition_costs`) cuts the layers
(balancing F + B per layer, with the ranks' speeds and their memory for
parameters, gradients and optimizer state), the simulator times one step and
tracks activations, and the collectives are added from
:mod:`stagewise.plan.comm`.

A candidate whose activations overflow a rank is cut once more with each
layer's activations counted (times the most micro-batches a stage holds), so a
rank short of memory gets fewer layers (:meth:`_Search.memory_cut`).

Pruning: each candidate first gets a *lower bound* on its step time that
holds for every schedule (see :func:`_rank_terms`); candidates are taken in
bound order and simulation stops once the bound reaches the ``top``-th best
step time found. A candidate whose parameters, gradients and optimizer state
(or one micro-batch of activations) already exceed a rank's memory is dropped
before it is simulated.

Gradient synchronisation (the runtime's ``SYNC``, after a stage's last
backward): with ``sharding == 1`` the all-reduce over ``dp`` is started at
SYNC and runs while the rank drains the pipeline, one collective after
another on the rank's link (``runtime/data_parallel.py``), so only what is
left after the rank's last compute adds to the step. With ``sharding > 1``
the runtime (FSDP2, ``runtime/sharding.py``) gathers parameters at a layer's
first forward and reduce-scatters at SYNC, blocking: those collectives are
costed as rank time at SYNC. The optimizer step itself is not costed.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from ..actions import Kind
from ..costs import CostModel
from ..parallel import ParallelConfig
from ..partition import partition_costs
from ..passes import add_grad_sync
from ..schedule import Schedule, loop_placement, v_placement
from ..schedules import generate, schedule_info
from ..simulate import SimResult, simulate
from .comm import Link, crosses_nodes, ring_all_gather, ring_all_reduce, ring_reduce_scatter
from .costing import LayerArrays, StageBase, StageCosts, layer_arrays, partition_weights, stage_base
from .inputs import Problem
from .ranking import rank_key, with_reasons
from .result import Dropped, Plan, PlanSearch, RankMemory, describe, gib


@dataclass(frozen=True)
class _Layout:
    config: ParallelConfig
    speeds: tuple[float, ...]  # per pp rank: the slowest rank of its group
    caps: tuple[float, ...]  # per pp rank: the smallest memory of its group
    links: dict[str, Link]
    per_replica: int


@dataclass(frozen=True)
class _Candidate:
    layout: _Layout
    schedule: str
    v: int
    m: int
    recompute: str | None
    bounds: tuple[int, ...]
    costs: StageCosts
    sync_blocking: tuple[float, ...]  # per stage, rank time at SYNC
    sync_async: tuple[float, ...]  # per stage, an all-reduce started at SYNC
    microbatch_size: int

    def describe(self) -> str:
        return describe(self.layout.config, self.schedule, self.v, self.m, self.recompute)


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


# ---- layouts ---------------------------------------------------------------------------


def _layouts(prob: Problem, why_not: list[str]) -> list[_Layout]:
    """Every pp x dp x sharding x tp of the processes that can run at all; the others' reasons go to ``why_not``."""
    n_layers, p = len(prob.profile), prob.processes
    out = []
    for pp in _divisors(p):
        if pp > n_layers:
            why_not.append(f"pp={pp}: more pipeline ranks than the {n_layers} layers")
            continue
        for tp in _divisors(p // pp):
            if tp > 1 and not prob.tp_layers:
                why_not.append(f"tp={tp}: no layer supports tensor parallelism (tp_layers is empty)")
                continue
            if tp > prob.max_tp:
                why_not.append(f"tp={tp}: above max_tp={prob.max_tp}")
                continue
            for sharding in _divisors(p // pp // tp):
                dp = p // pp // tp // sharding
                config = ParallelConfig(pp=pp, dp=dp, tp=tp, sharding=sharding)
                if prob.global_batch % config.replicas:
                    why_not.append(
                        f"{config.describe()}: {config.replicas} replicas do not divide the global batch "
                        f"{prob.global_batch}"
                    )
                    continue
                out.append(_layout(prob, config))
    return out


def _layout(prob: Problem, config: ParallelConfig) -> _Layout:
    group = prob.processes // config.pp
    speeds = tuple(min(prob.speeds[k * group : (k + 1) * group]) for k in range(config.pp))
    caps = tuple(min(prob.memory[k * group : (k + 1) * group]) for k in range(config.pp))
    links = {
        axis: prob.inter if crosses_nodes(config, axis, prob.per_node) else prob.intra
        for axis in ("pp", "dp", "sharding", "tp")
    }
    return _Layout(config, speeds, caps, links, prob.global_batch // config.replicas)


# ---- schedules -------------------------------------------------------------------------


def _schedule_options(prob: Problem, pp: int) -> list[tuple[str, int]]:
    """(schedule, v) pairs to try; one stage per rank needs no pipeline schedule, so pp = 1 tries 1f1b alone."""
    if pp == 1:
        return [("1f1b", 1)] if "1f1b" in prob.schedules else [(prob.schedules[0], 1)]
    n_layers = len(prob.profile)
    out = []
    for name in prob.schedules:
        info = schedule_info(name)
        if info.virtual_stages is None:  # v = 1 is another registered schedule (1f1b, gpipe): start at 2
            vs = list(range(2, prob.max_virtual_stages + 1))
        else:
            vs = list(info.virtual_stages)
        out += [(name, v) for v in vs if pp * v <= n_layers]
    return out


@lru_cache(maxsize=4096)
def _splits_backward(name: str) -> bool:
    s = generate(name, 2, 4, None)
    return any(a.kind is Kind.I for acts in s.ranks for a in acts)


@lru_cache(maxsize=256)
def _compute_schedule(name: str, pp: int, m: int, v: int) -> Schedule:
    return add_grad_sync(generate(name, pp, m, v))


#: per rank, its activation states: (its stages, full activations held per stage, W-only parts held per stage)
_States = tuple[tuple[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]], ...], ...]


@lru_cache(maxsize=1024)
def _activation_states(name: str, pp: int, m: int, v: int) -> _States:
    """Per rank, each distinct state right after a forward: (stages, full activations held, W-only parts held).

    A rank's activation memory only rises at a forward and depends on its action order alone, not on
    timing, so the peak bytes for any stage sizes is the largest dot product over these states
    (the simulator's ``peak_activation_bytes``, without simulating).
    """
    schedule = generate(name, pp, m, v)
    out = []
    for rank, acts in enumerate(schedule.ranks):
        stages = schedule.stages_of(rank)
        index = {st: k for k, st in enumerate(stages)}
        full, keep = [0] * len(stages), [0] * len(stages)
        states = set()
        for a in acts:
            k = index[a.stage]
            if a.kind is Kind.F:
                full[k] += 1
                states.add((tuple(full), tuple(keep)))
            elif a.kind is Kind.B:
                full[k] -= 1
            elif a.kind is Kind.I:
                full[k] -= 1
                keep[k] += 1
            elif a.kind is Kind.W:
                keep[k] -= 1
        out.append(tuple((stages, f, w) for f, w in _maximal(states)))
    return tuple(out)


def _maximal(states: set[tuple[tuple[int, ...], tuple[int, ...]]]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The states no other state dominates (holds at least as much of everything): only they can be the peak."""
    flat = sorted(states, key=lambda st: -(sum(st[0]) + sum(st[1])))
    keep: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for st in flat:
        vec = st[0] + st[1]
        if not any(all(a >= b for a, b in zip(k[0] + k[1], vec)) for k in keep):
            keep.append(st)
    return keep


def _activation_peaks(c: _Candidate) -> list[float]:
    """Peak activation bytes per pp rank (recompute's transient included): what the simulator would find."""
    config = c.layout.config
    act, keep = c.costs.activation, c.costs.keep
    peaks = []
    for states in _activation_states(c.schedule, config.pp, c.m, c.v):
        best = 0.0
        for stages, full, kept in states:
            total = sum(n * act[s] for n, s in zip(full, stages)) + sum(n * keep[s] for n, s in zip(kept, stages))
            best = max(best, total)
        if c.recompute == "stage" and states:
            best += max(c.costs.full_activation[s] for s in states[0][0])
        peaks.append(best)
    return peaks


@lru_cache(maxsize=4096)
def _placement(name: str, pp: int, v: int) -> tuple[int, ...]:
    return loop_placement(pp, v) if schedule_info(name).placement == "loop" else v_placement(pp, v)


# ---- one candidate ---------------------------------------------------------------------


def _static_memory(c: _Candidate, prob: Problem) -> list[RankMemory]:
    """Parameters, gradients and optimizer state per pp rank; activations 0 (filled in after simulating).

    The runtime's sharding gathers a stage's parameters at its first forward and accumulates whole
    gradients until SYNC, so only the optimizer state is divided by ``sharding`` at the peak.
    """
    config = c.layout.config
    placement = _placement(c.schedule, config.pp, c.v)
    params = [0.0] * config.pp
    for s, r in enumerate(placement):
        params[r] += c.costs.parameters[s]
    return [
        RankMemory(
            parameters=params[r],
            gradients=params[r],
            optimizer=prob.optimizer_state * params[r] / config.sharding,
            activations=0.0,
            cap=c.layout.caps[r],
        )
        for r in range(config.pp)
    ]


def _rank_terms(
    costs: StageCosts,
    placement: Sequence[int],
    splits: bool,
    link: Link,
    sync_blocking: Sequence[float],
    sync_async: Sequence[float],
) -> list[tuple[float, float, float, float, float]]:
    """Per rank, the terms of a step-time bound no schedule can beat with these stage costs.

    Rank r cannot start before micro-batch 0 has passed the stages below its lowest one (``pre``);
    it then runs all its work and the gradient sync of the stage it finishes last; and after the
    last input-gradient it computes, that gradient still has to pass every stage below (``post``).
    Returns (pre, post, work per micro-batch, F + I per micro-batch, sync) per rank:
    bound = max over ranks of ``pre + max(m * work + sync, m * fi + post)``.
    """
    p = max(placement) + 1
    f, i, w = costs.forward, costs.backward_input, costs.backward_weight
    n = len(placement)
    lowest = [n] * p
    for s, r in enumerate(placement):
        lowest[r] = min(lowest[r], s)
    prefix_f, prefix_i = [0.0], [0.0]
    for s in range(n):
        hop = link.time(costs.output[s]) if s + 1 < n and placement[s + 1] != placement[s] else 0.0
        prefix_f.append(prefix_f[-1] + f[s] + hop)
        back = i[s] if splits else i[s] + w[s]
        hop_b = link.time(costs.output[s - 1]) if s > 0 and placement[s - 1] != placement[s] else 0.0
        prefix_i.append(prefix_i[-1] + back + hop_b)
    work, fi, blocking = [0.0] * p, [0.0] * p, [0.0] * p
    sync_min = [math.inf] * p
    for s, r in enumerate(placement):
        work[r] += f[s] + i[s] + w[s]
        fi[r] += f[s] + (i[s] if splits else i[s] + w[s])
        blocking[r] += sync_blocking[s]
        sync_min[r] = min(sync_min[r], sync_async[s])
    return [(prefix_f[lowest[r]], prefix_i[lowest[r]], work[r], fi[r], blocking[r] + sync_min[r]) for r in range(p)]


def _simulate(c: _Candidate) -> tuple[SimResult, float, list[float]]:
    """Simulate; return the result, the step time with the asynchronous all-reduces, and each rank's end."""
    config = c.layout.config
    schedule = _compute_schedule(c.schedule, config.pp, c.m, c.v)
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


def _memory_floor(c: _Candidate, prob: Problem, placement: Sequence[int]) -> list[RankMemory]:
    """A cheap lower bound of :func:`_memory`: every forward of a stage allocates one micro-batch's activations."""
    floor = [0.0] * c.layout.config.pp
    for s, r in enumerate(placement):
        one = c.costs.activation[s] + (c.costs.full_activation[s] if c.recompute == "stage" else 0.0)
        floor[r] = max(floor[r], one)
    return [
        RankMemory(m.parameters, m.gradients, m.optimizer, act, m.cap) for m, act in zip(_static_memory(c, prob), floor)
    ]


def _memory(c: _Candidate, prob: Problem) -> list[RankMemory]:
    """Predicted peak memory per pp rank: static terms plus the activation peak of the schedule's order."""
    return [
        RankMemory(m.parameters, m.gradients, m.optimizer, act, m.cap)
        for m, act in zip(_static_memory(c, prob), _activation_peaks(c))
    ]


def _evaluate(c: _Candidate, memory: list[RankMemory]) -> Plan:
    """Simulate a candidate that fits memory into a plan."""
    config = c.layout.config
    sim, step, _ = _simulate(c)
    placement = _placement(c.schedule, config.pp, c.v)
    busy = [0.0] * config.pp
    tp_comm = [0.0] * config.pp
    for s, r in enumerate(placement):
        busy[r] += c.m * (c.costs.forward[s] + c.costs.backward_input[s] + c.costs.backward_weight[s])
        tp_comm[r] += c.m * c.costs.tp_comm[s]
    busiest = max(range(config.pp), key=lambda r: busy[r])
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
            "grad_sync": step - sim.makespan + max(_per_rank(c.sync_blocking, placement, config.pp)),
            "pipeline_idle": sim.bubble_ratio * sim.makespan,
        },
    )


def _per_rank(values: Sequence[float], placement: Sequence[int], p: int) -> list[float]:
    out = [0.0] * p
    for s, r in enumerate(placement):
        out[r] += values[s]
    return out


def _over_cap(rank: int, mem: RankMemory) -> str:
    return (
        f"pipeline rank {rank} needs {gib(mem.total)} > its memory {gib(mem.cap)} "
        f"(parameters {gib(mem.parameters)}, gradients {gib(mem.gradients)}, optimizer state "
        f"{gib(mem.optimizer)}, activations {gib(mem.activations)}; {mem.dominant} dominate)"
    )


# ---- the search ------------------------------------------------------------------------


class _Partitions:
    """The exact partition for each (layout shape, stages, tp, recompute, speeds, caps), computed once."""

    def __init__(self, prob: Problem) -> None:
        self.prob = prob
        self.arrays: dict[int, LayerArrays] = {}
        self.cache: dict[tuple[object, ...], tuple[tuple[int, ...], StageBase] | str] = {}

    def layer_arrays(self, tp: int) -> LayerArrays:
        if tp not in self.arrays:
            self.arrays[tp] = layer_arrays(self.prob.profile, tp, self.prob.tp_layers)
        return self.arrays[tp]

    def get(
        self, layout: _Layout, placement: Sequence[int], v: int, recompute: str | None
    ) -> tuple[tuple[int, ...], StageBase] | str:
        config = layout.config
        speeds = tuple(layout.speeds[r] for r in placement)
        finite = any(not math.isinf(c) for c in layout.caps)
        # parameters + gradients + optimizer state per parameter byte (see _static_memory)
        per_byte = 2 + self.prob.optimizer_state / config.sharding
        caps = tuple(layout.caps[r] / v / per_byte for r in placement) if finite else None
        tp_link = layout.links["tp"]
        free_key = (config.tp, recompute, speeds, tp_link if config.tp > 1 else None)
        got = self._partition(free_key, None)
        if caps is None or isinstance(got, str):
            return got
        arrays = self.layer_arrays(config.tp)
        bounds = got[0]
        if all(sum(arrays.parameters[a:b]) <= cap for a, b, cap in zip(bounds, bounds[1:], caps)):
            return got  # the fastest cut already fits: no need to cut again under the caps
        if sum(arrays.parameters) > sum(caps) or max(arrays.parameters) > max(caps):
            return got  # no cut can fit: the memory check will say by how much
        capped = self._partition((*free_key, caps), caps)
        # no cut fits: keep the fastest, so the memory check reports its exact peak and what dominates it
        return got if isinstance(capped, str) else capped

    def _partition(
        self, key: tuple[object, ...], caps: tuple[float, ...] | None
    ) -> tuple[tuple[int, ...], StageBase] | str:
        tp, recompute, speeds, tp_link = key[:4]
        if key not in self.cache:
            arrays = self.layer_arrays(tp)  # type: ignore[arg-type]
            link = tp_link if isinstance(tp_link, Link) else Link()
            weights = partition_weights(
                arrays,
                tp=tp,  # type: ignore[arg-type]
                tp_link=link,
                recompute=recompute,  # type: ignore[arg-type]
                overhead=self.prob.overhead,
            )
            try:
                part = partition_costs(
                    weights,
                    len(speeds),  # type: ignore[arg-type]
                    speeds=speeds,  # type: ignore[arg-type]
                    memory=arrays.parameters if caps is not None else None,
                    memory_caps=caps,
                )
            except ValueError as err:
                self.cache[key] = f"parameters, gradients and optimizer state do not fit: {err}"
            else:
                base = stage_base(
                    arrays,
                    part.bounds,
                    tp=tp,  # type: ignore[arg-type]
                    tp_link=link,
                    recompute=recompute,  # type: ignore[arg-type]
                    overhead=self.prob.overhead,
                    action_overhead=self.prob.action_overhead,
                )
                self.cache[key] = (part.bounds, base)
        return self.cache[key]


def _sync_costs(layout: _Layout, params: Sequence[float]) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per stage: (blocking seconds at SYNC, an asynchronous all-reduce started there); see the module docstring."""
    config, links = layout.config, layout.links
    blocking, background = [], []
    for nbytes in params:
        if config.sharding > 1:
            t = ring_all_gather(nbytes, config.sharding, links["sharding"])
            t += ring_reduce_scatter(nbytes, config.sharding, links["sharding"])
            t += ring_all_reduce(nbytes / config.sharding, config.dp, links["dp"])
            blocking.append(t)
            background.append(0.0)
        else:
            blocking.append(0.0)
            background.append(ring_all_reduce(nbytes, config.dp, links["dp"]))
    return tuple(blocking), tuple(background)


@dataclass(frozen=True)
class _Group:
    """The candidates that share a layout, schedule, v and recompute choice (and so a partition); m varies."""

    layout: _Layout
    schedule: str
    v: int
    recompute: str | None


def _group_bound(prob: Problem, parts: _Partitions, g: _Group) -> float:
    """A bound for every m of the group, before partitioning: the busiest rank does at least its share.

    Each pp rank computes ``per_replica / profile_batch`` samples' worth of its layers at its speed, so
    the step is at least all layers' work over the summed speeds, and at least the costliest layer's
    work on the fastest rank (the parts of the work that do not shrink with the batch are left out).
    """
    arrays = parts.layer_arrays(g.layout.config.tp)
    work = [
        f + i + w + (f if g.recompute == "stage" else 0.0)
        for f, i, w in zip(arrays.forward, arrays.backward_input, arrays.backward_weight)
    ]
    samples = g.layout.per_replica / prob.profile_batch
    return samples * max(sum(work) / sum(g.layout.speeds), max(work) / max(g.layout.speeds))


class _Search:
    """Best first: groups by their bound, expanded into candidates by theirs, simulated until no bound can win."""

    def __init__(self, prob: Problem) -> None:
        self.prob = prob
        self.parts = _Partitions(prob)
        self.dropped: list[Dropped] = []
        self.smallest: tuple[float, str, RankMemory] | None = None  # (peak / cap, what, memory) of the closest miss
        self.queue: list[tuple[float, int, Any]] = []  # a _Group, or (group, m, bounds, base, sync costs)
        self.counter = 0
        self.expanded = 0

    def push(self, bound: float, item: Any) -> None:
        self.counter += 1
        heapq.heappush(self.queue, (bound, self.counter, item))

    def miss(self, what: str, memory: Sequence[RankMemory], exact: bool, cand: _Candidate) -> None:
        """Keep the reason, and the memory of the candidate closest to fitting (for the error message)."""
        worst = max(memory, key=lambda mem: mem.total / mem.cap)
        if self.smallest is None or worst.total / worst.cap < self.smallest[0]:
            if not exact:
                worst = max(_memory(cand, self.prob), key=lambda mem: mem.total / mem.cap)
            self.smallest = (worst.total / worst.cap, what, worst)
        r = next(r for r, mem in enumerate(memory) if mem.total > mem.cap)
        tail = "" if exact else " already with one micro-batch in flight"
        self.dropped.append(Dropped(what, _over_cap(r, memory[r]) + tail))

    def expand(self, g: _Group) -> None:
        """Partition the group's layers and push each micro-batch count that can run, with its bound.

        Every per-rank term of the bound is affine in the micro-batch size (the costs are), so the
        terms are worked out at sizes 0 and 1 once and each micro-batch count costs O(ranks).
        """
        prob, config = self.prob, g.layout.config
        self.expanded += 1
        info = schedule_info(g.schedule)
        placement = _placement(g.schedule, config.pp, g.v)
        splits = _splits_backward(g.schedule)
        got = self.parts.get(g.layout, placement, g.v, g.recompute)
        if isinstance(got, str):
            self.dropped.append(
                Dropped(describe(config, g.schedule, g.v, 0, g.recompute).replace("m=0", "every m"), got)
            )
            return
        bounds, base = got
        at0, at1 = base.at(0.0), base.at(1.0)
        blocking, background = _sync_costs(g.layout, at1.parameters)
        link = g.layout.links["pp"]
        t0 = _rank_terms(at0, placement, splits, link, blocking, background)
        t1 = _rank_terms(at1, placement, splits, link, blocking, background)
        slopes = [tuple(y - x for x, y in zip(a, b)) for a, b in zip(t0, t1)]
        static = _static_memory(
            _Candidate(g.layout, g.schedule, g.v, 1, g.recompute, bounds, at1, blocking, background, 1), prob
        )
        act_floor = [0.0] * config.pp  # activation bytes a rank reaches at least, per unit of micro-batch size
        for s, r in enumerate(placement):
            one = at1.activation[s] + (at1.full_activation[s] if g.recompute == "stage" else 0.0)
            act_floor[r] = max(act_floor[r], one)
        for m in _divisors(g.layout.per_replica):
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
                costs = base.at(sigma)
                cand = _Candidate(g.layout, g.schedule, g.v, m, g.recompute, bounds, costs, blocking, background, size)
                if self.memory_cut(g, cand):
                    continue
                cand = _Candidate(g.layout, g.schedule, g.v, m, g.recompute, bounds, costs, blocking, background, size)
                self.miss(what, floor, False, cand)
                continue
            bound = 0.0
            for (pre, post, work, fi, sync), (dpre, dpost, dwork, dfi, _) in zip(t0, slopes):
                pre_s = pre + sigma * dpre
                rest = max(m * (work + sigma * dwork) + sync, m * (fi + sigma * dfi) + post + sigma * dpost)
                bound = max(bound, pre_s + rest)
            self.push(bound, (g, m, bounds, base, blocking, background, False))

    def memory_cut(self, g: _Group, cand: _Candidate) -> bool:
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
        states = _activation_states(g.schedule, config.pp, cand.m, g.v)
        held = max((f + w for rank in states for _, full, kept in rank for f, w in zip(full, kept)), default=1)
        arrays = self.parts.layer_arrays(config.tp)
        sigma = cand.microbatch_size / prob.profile_batch
        per_byte = 2 + prob.optimizer_state / config.sharding
        memory = [par * per_byte + held * act * sigma for par, act in zip(arrays.parameters, arrays.activation)]
        placement = _placement(g.schedule, config.pp, g.v)
        caps = [g.layout.caps[r] / g.v for r in placement]
        tp_link = g.layout.links["tp"]
        weights = partition_weights(arrays, tp=config.tp, tp_link=tp_link, recompute=None, overhead=prob.overhead)
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
        )
        costs = base.at(sigma)
        blocking, background = _sync_costs(g.layout, costs.parameters)
        link = g.layout.links["pp"]
        terms = _rank_terms(costs, placement, _splits_backward(g.schedule), link, blocking, background)
        bound = max(pre + max(cand.m * work + sync, cand.m * fi + post) for pre, post, work, fi, sync in terms)
        self.push(bound, (g, cand.m, part.bounds, base, blocking, background, True))
        return True

    def run(self, layouts: list[_Layout]) -> PlanSearch:
        prob = self.prob
        candidates = 0
        for layout in layouts:
            for name, v in _schedule_options(prob, layout.config.pp):
                for recompute in prob.recompute:
                    g = _Group(layout, name, v, recompute)
                    candidates += len(_divisors(layout.per_replica))
                    self.push(_group_bound(prob, self.parts, g), g)
        best: list[float] = []  # max-heap (negated) of the top step times found
        plans: list[Plan] = []
        simulated = 0
        while self.queue:
            bound, _, item = self.queue[0]
            if len(best) >= prob.top and bound >= -best[0] * (1 + 1e-12):
                break
            heapq.heappop(self.queue)
            if isinstance(item, _Group):
                self.expand(item)
                continue
            g, m, bounds, base, blocking, background, recut = item
            size = g.layout.per_replica // m
            costs = base.at(size / prob.profile_batch)
            item = _Candidate(g.layout, g.schedule, g.v, m, g.recompute, bounds, costs, blocking, background, size)
            memory = _memory(item, prob)
            if any(mem.total > mem.cap for mem in memory):
                if not recut and self.memory_cut(g, item):
                    continue
                self.miss(item.describe(), memory, True, item)
                continue
            simulated += 1
            result = _evaluate(item, memory)
            plans.append(result)
            heapq.heappush(best, -result.step_time)
            if len(best) > prob.top:
                heapq.heappop(best)
        if not plans:
            raise ValueError(_no_plan_message(prob, self.smallest, self.dropped))
        ranked = with_reasons(sorted(plans, key=rank_key)[: prob.top])
        return PlanSearch(
            plans=tuple(ranked),
            candidates=candidates,
            groups_expanded=self.expanded,
            simulated=simulated,
            dropped=tuple(self.dropped),
            layouts=len(layouts),
        )


def run_search(prob: Problem) -> PlanSearch:
    """Enumerate the layouts (or say why none works), then search them best first."""
    why_not: list[str] = []
    layouts = _layouts(prob, why_not)
    if not layouts:
        raise ValueError(
            f"plan: no factorisation pp x dp x sharding x tp of {prob.processes} processes works: "
            + "; ".join(why_not[:8])
            + (f"; ... ({len(why_not)} in all)" if len(why_not) > 8 else "")
        )
    return _Search(prob).run(layouts)


def _no_plan_message(prob: Problem, smallest: tuple[float, str, RankMemory] | None, dropped: Sequence[Dropped]) -> str:
    if smallest is None:
        reasons = sorted({d.reason for d in dropped})
        return f"plan: no candidate can run: {'; '.join(reasons[:5])}"
    _, what, mem = smallest
    return (
        f"plan: no plan fits the memory cap: the smallest predicted peak is {gib(mem.total)} against "
        f"{gib(mem.cap)} ({what}); {mem.dominant} dominate it (parameters {gib(mem.parameters)}, gradients "
        f"{gib(mem.gradients)}, optimizer state {gib(mem.optimizer)}, activations {gib(mem.activations)})"
    )
