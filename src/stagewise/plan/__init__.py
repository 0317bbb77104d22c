"""The planner: from a layer profile to ranked ways of running the model (DAPPLE's profiler -> planner -> runtime).

Pure (no torch). :func:`plan` searches layouts (pp x dp x sharding x tp),
schedules, virtual stages, micro-batch counts, partitions and recompute,
predicts each one's step time and per-rank peak memory with the simulator,
and returns the best as :class:`Plan` values; ``stagewise.runtime.from_plan``
turns one into a ``Pipeline``. :mod:`.search` says how, :mod:`.costing` how
costs scale, :mod:`.comm` how collectives are costed.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence

from ..profile_data import LayerProfile
from .comm import Link, ring_all_gather, ring_all_reduce, ring_reduce_scatter
from .inputs import make_problem
from .result import Dropped, Plan, PlanSearch, RankMemory
from .search import run_search

#: a link with no latency and infinite bandwidth: the default, so a plan with no link data ignores transfers
FREE_LINK = Link()

__all__ = [
    "Dropped",
    "Link",
    "Plan",
    "PlanSearch",
    "RankMemory",
    "plan",
    "ring_all_gather",
    "ring_all_reduce",
    "ring_reduce_scatter",
    "search",
]


def search(
    profile: LayerProfile,
    processes: int,
    *,
    global_batch: int,
    memory: float | Sequence[float] = math.inf,
    speeds: float | Sequence[float] | None = None,
    nodes: int = 1,
    profile_batch: int = 1,
    optimizer_state: float = 2.0,
    intra: Link = FREE_LINK,
    inter: Link | None = None,
    tp_layers: Collection[int | str] = (),
    max_tp: int | None = None,
    schedules: Sequence[str] | None = None,
    max_virtual_stages: int = 4,
    recompute: Sequence[str | None] = (None, "stage"),
    overhead: float | Sequence[float] = 0.0,
    action_overhead: float = 0.0,
    top: int = 5,
) -> PlanSearch:
    """Like :func:`plan`, returning the whole search: plans, candidates, pruned, simulated, dropped with reasons."""
    problem = make_problem(
        profile,
        processes,
        global_batch=global_batch,
        memory=memory,
        speeds=speeds,
        nodes=nodes,
        profile_batch=profile_batch,
        optimizer_state=optimizer_state,
        intra=intra,
        inter=inter,
        tp_layers=tp_layers,
        max_tp=max_tp,
        schedules=schedules,
        max_virtual_stages=max_virtual_stages,
        recompute=recompute,
        overhead=overhead,
        action_overhead=action_overhead,
        top=top,
    )
    return run_search(problem)


def plan(
    profile: LayerProfile,
    processes: int,
    *,
    global_batch: int,
    memory: float | Sequence[float] = math.inf,
    speeds: float | Sequence[float] | None = None,
    nodes: int = 1,
    profile_batch: int = 1,
    optimizer_state: float = 2.0,
    intra: Link = FREE_LINK,
    inter: Link | None = None,
    tp_layers: Collection[int | str] = (),
    max_tp: int | None = None,
    schedules: Sequence[str] | None = None,
    max_virtual_stages: int = 4,
    recompute: Sequence[str | None] = (None, "stage"),
    overhead: float | Sequence[float] = 0.0,
    action_overhead: float = 0.0,
    top: int = 5,
) -> list[Plan]:
    """The ``top`` fastest plans that fit memory, fastest first, each saying why it beat the next.

    ``profile``: per-layer times and bytes of one micro-batch of ``profile_batch`` samples
    (:func:`stagewise.profile`); costs scale linearly with the micro-batch size.
    ``processes`` ranks on ``nodes`` nodes (packed in rank order), each with
    ``memory`` bytes and relative ``speeds`` (one number, or one per rank).
    ``global_batch``: samples per step, split over the ``dp * sharding`` replicas, then into
    micro-batches. ``optimizer_state``: optimizer bytes per parameter byte (AdamW: 2).
    ``intra`` / ``inter``: the links inside a node and between nodes (``inter``
    defaults to ``intra``). ``tp_layers``: indices or names of the layers that
    can be split by tensor parallelism (no tp without them); ``max_tp``
    defaults to the processes per node. ``overhead``: seconds of each layer's
    forward and of its backward that do not scale with the batch (one number, or one per layer);
    ``action_overhead``: the runtime's seconds per stage forward and per backward.

    Raises ``ValueError`` when no factorisation of ``processes`` can run, or
    when no plan fits ``memory`` (naming the smallest peak and its largest term).
    """
    return list(
        search(
            profile,
            processes,
            global_batch=global_batch,
            memory=memory,
            speeds=speeds,
            nodes=nodes,
            profile_batch=profile_batch,
            optimizer_state=optimizer_state,
            intra=intra,
            inter=inter,
            tp_layers=tp_layers,
            max_tp=max_tp,
            schedules=schedules,
            max_virtual_stages=max_virtual_stages,
            recompute=recompute,
            overhead=overhead,
            action_overhead=action_overhead,
            top=top,
        ).plans
    )
