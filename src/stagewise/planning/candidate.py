"""One candidate (layout, schedule, v, m, recompute, partition) and its cost terms: memory, collectives, bounds.

Gradient synchronisation (the runtime's ``SYNC``, after a stage's last
backward): with ``sharding == 1`` the all-reduce over ``dp`` is started at
SYNC and runs while the rank drains the pipeline, one collective after
another on the rank's link (``runtime/hybrid/data_parallel.py``), so only what is
left after the rank's last compute adds to the step. With ``sharding > 1``
the runtime (FSDP2, ``runtime/hybrid/sharding.py``) gathers parameters at a layer's
first forward and reduce-scatters at SYNC, blocking: those collectives are
costed as rank time at SYNC (:func:`sync_costs`). The optimizer step itself is not costed.

Layers tied across stages (``LayerProfile.tied``: a token embedding and the head reusing it) have their
gradients summed over the ranks holding them and their replicas at the step's end, outside the action list:
:func:`tied_costs` prices each sum on the candidate's links (:mod:`.tied_sum`), and the step waits for it
(:func:`stagewise.planning.predict.ends_with_async_sync`). The stage holding a tied weight leaves it out of
its own collectives at SYNC, as the runtime does; its memory still counts it (:func:`static_memory`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .calibration import Calibration
from .comm import Link, ring_all_gather, ring_all_reduce, ring_reduce_scatter
from .costing import StageCosts
from .inputs import Problem
from .layouts import Layout
from .orders import activation_states, placement_of
from .result import RankMemory, describe, gib
from .tied_sum import TiedSum, tied_sums


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    schedule: str
    v: int
    m: int
    recompute: str | None
    bounds: tuple[int, ...]
    costs: StageCosts
    sync_blocking: tuple[float, ...]  # per stage, rank time at SYNC
    sync_async: tuple[float, ...]  # per stage, an all-reduce started at SYNC
    microbatch_size: int
    tied: tuple[TiedSum, ...] = ()  # the tied layers' gradient sums the step waits for (:func:`tied_costs`)

    def describe(self) -> str:
        return describe(self.layout.config, self.schedule, self.v, self.m, self.recompute)


def activation_peaks(c: Candidate) -> list[float]:
    """Peak activation bytes per pp rank (recompute's transient included): what the simulator would find."""
    config = c.layout.config
    act, keep = c.costs.activation, c.costs.keep
    peaks = []
    for states in activation_states(c.schedule, config.pp, c.m, c.v):
        best = 0.0
        for stages, full, kept in states:
            total = sum(n * act[s] for n, s in zip(full, stages)) + sum(n * keep[s] for n, s in zip(kept, stages))
            best = max(best, total)
        if c.recompute == "stage" and states:
            best += max(c.costs.full_activation[s] for s in states[0][0])
        peaks.append(best)
    return peaks


def static_memory(c: Candidate, prob: Problem) -> list[RankMemory]:
    """Parameters, gradients and optimizer state per pp rank; activations 0 (filled in after simulating).

    The runtime's sharding gathers a stage's parameters at its first forward and accumulates whole
    gradients until SYNC, so only the optimizer state is divided by ``sharding`` at the peak.
    """
    config = c.layout.config
    placement = placement_of(c.schedule, config.pp, c.v)
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


def rank_terms(
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
    bound = max over ranks of ``pre + max(m * work + sync, m * fi + post)``. A schedule that ``splits`` runs I and
    W, one that does not B, each at its own cost.
    """
    p = max(placement) + 1
    f, i, w, b = costs.forward, costs.backward_input, costs.backward_weight, costs.backward_times()
    n = len(placement)
    lowest = [n] * p
    for s, r in enumerate(placement):
        lowest[r] = min(lowest[r], s)
    prefix_f, prefix_i = [0.0], [0.0]
    for s in range(n):
        hop = link.time(costs.output[s]) if s + 1 < n and placement[s + 1] != placement[s] else 0.0
        prefix_f.append(prefix_f[-1] + f[s] + hop)
        back = i[s] if splits else b[s]
        hop_b = link.time(costs.output[s - 1]) if s > 0 and placement[s - 1] != placement[s] else 0.0
        prefix_i.append(prefix_i[-1] + back + hop_b)
    work, fi, blocking = [0.0] * p, [0.0] * p, [0.0] * p
    sync_min = [math.inf] * p
    for s, r in enumerate(placement):
        work[r] += f[s] + (i[s] + w[s] if splits else b[s])
        fi[r] += f[s] + (i[s] if splits else b[s])
        blocking[r] += sync_blocking[s]
        sync_min[r] = min(sync_min[r], sync_async[s])
    return [(prefix_f[lowest[r]], prefix_i[lowest[r]], work[r], fi[r], blocking[r] + sync_min[r]) for r in range(p)]


def memory_of(c: Candidate, prob: Problem) -> list[RankMemory]:
    """Predicted peak memory per pp rank: static terms plus the activation peak of the schedule's order."""
    return [
        RankMemory(m.parameters, m.gradients, m.optimizer, act, m.cap)
        for m, act in zip(static_memory(c, prob), activation_peaks(c))
    ]


def over_cap(rank: int, mem: RankMemory) -> str:
    return (
        f"pipeline rank {rank} needs {gib(mem.total)} > its memory {gib(mem.cap)} "
        f"(parameters {gib(mem.parameters)}, gradients {gib(mem.gradients)}, optimizer state "
        f"{gib(mem.optimizer)}, activations {gib(mem.activations)}; {mem.dominant} dominate)"
    )


def sync_costs(
    layout: Layout, costs: StageCosts, calibration: Calibration
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per stage: (blocking seconds at SYNC, an asynchronous all-reduce started there); see the module docstring.

    Sharding's gather + reduce-scatter come from ``calibration`` when it measured FSDP2 on the
    group (:meth:`Calibration.sharding_time`), else from the ring model. Each moves the stage's parameters
    less its tied weights (:meth:`StageCosts.reduced_bytes`): those have a sum of their own (:func:`tied_costs`).
    """
    config, links = layout.config, layout.links
    blocking, background = [], []
    for s, nbytes in enumerate(costs.reduced_bytes()):
        if config.sharding > 1:
            units = costs.units[s] if costs.units else 1
            t = calibration.sharding_time(nbytes, units, config.sharding)
            if t is None:
                t = ring_all_gather(nbytes, config.sharding, links["sharding"])
                t += ring_reduce_scatter(nbytes, config.sharding, links["sharding"])
            t += ring_all_reduce(nbytes / config.sharding, config.dp, links["dp"])
            blocking.append(t)
            background.append(0.0)
        else:
            blocking.append(0.0)
            background.append(ring_all_reduce(nbytes, config.dp, links["dp"]))
    return tuple(blocking), tuple(background)


def tied_costs(
    layout: Layout, placement: Sequence[int], bounds: Sequence[int], tied: Sequence[tuple[Sequence[int], float]]
) -> tuple[TiedSum, ...]:
    """The gradient sums of the ``tied`` layers (``LayerProfile.tied``) of a candidate that cuts the layers at
    ``bounds`` onto pipeline ranks by ``placement`` (:func:`~.tied_sum.tied_sums`): a ring over the ranks holding
    them and their replicas, on the pipeline's link between nodes where those ranks span nodes, else on the one
    inside a node; a set held by one rank, over its replicas (``dp x sharding``) on their axis's link."""
    if not tied:
        return ()
    config, links = layout.config, layout.links
    counts = [b - a for a, b in zip(bounds, bounds[1:])]
    return tied_sums(tied, counts, placement, between=links["pp"], local=layout.local,
                     replicas=links["dp" if config.dp > 1 else "sharding"], dp=config.replicas,
                     nodes=layout.nodes or None)  # fmt: skip
