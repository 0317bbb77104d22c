"""Schedules that write themselves: the fastest valid schedule found for measured costs under a memory cap.

* :func:`synthesize`: costs (a :class:`~stagewise.simulation.CostModel`, or per-stage F / I / W times), ranks,
  micro-batches, caps -> a complete, validated :class:`~stagewise.ir.Schedule` whose ``meta["synthesis"]``
  reports its makespan beside the lower bound and the best hand-written schedule that fits;
* :func:`synthesize_for`: the same from a measured :class:`~stagewise.partition.LayerProfile` and a partition
  (what ``schedule="auto"`` runs);
* :func:`lower_bound`: no valid schedule for these costs is faster (:mod:`.bound` proves it);
* :func:`placement_for`: which rank holds which stage, known before the costs are.

How: :mod:`.problem` (what is asked, checked once), :mod:`.starts` (every registered schedule that fits, a
one-at-a-time order), :mod:`.greedy` (the ranks play the step out under a policy; after the Zero Bubble
paper's heuristic), :mod:`.improve` (local moves on the critical path), :mod:`.fusion` (where a whole
backward B beats its split I + W), :mod:`.exact` (CP-SAT for small problems, when asked), all timed by the
simulator's own walk (:mod:`.orders`); :mod:`.synthesis` runs them and lowers the result with the ordinary
passes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from .._util import is_count
from ..ir import Schedule
from ..partition import LayerProfile
from ..simulation import CostModel
from .bound import bound_of
from .problem import make_problem
from .synthesis import Synthesis, report_of, synthesize

__all__ = ["Synthesis", "lower_bound", "placement_for", "report_of", "synthesize", "synthesize_for"]


def placement_for(num_ranks: int, virtual_stages: int = 1, placement: str | None = None) -> tuple[int, ...]:
    """Stage -> rank of a synthesized schedule, known before it is synthesized (V for v = 2, else loop, unless
    ``placement`` says): a runtime can build each rank's stages, then profile them, then synthesize."""
    problem = make_problem(
        [(0.0, 0.0, 0.0)] * (num_ranks * virtual_stages) if is_count(num_ranks) and is_count(virtual_stages) else [],
        num_ranks,
        1,
        memory=math.inf,
        memory_bytes=None,
        virtual_stages=virtual_stages,
        placement=placement,
    )
    return problem.placement


def lower_bound(
    costs: CostModel | Sequence[Sequence[float]],
    num_ranks: int,
    microbatches: int,
    *,
    virtual_stages: int = 1,
    placement: str | None = None,
) -> float:
    """A makespan no valid schedule of these costs beats, under any memory cap (see :mod:`.bound`)."""
    problem = make_problem(
        costs,
        num_ranks,
        microbatches,
        memory=math.inf,
        memory_bytes=None,
        virtual_stages=virtual_stages,
        placement=placement,
    )
    return bound_of(problem).value


def synthesize_for(
    source: CostModel | LayerProfile,
    num_ranks: int,
    microbatches: int,
    *,
    partition: Sequence[int] | None = None,
    virtual_stages: int = 1,
    memory: float | Sequence[float] | None = None,
    memory_bytes: float | Sequence[float] | None = None,
    latency: float = 0.0,
    bandwidth: float = math.inf,
    placement: str | None = None,
) -> Schedule:
    """:func:`synthesize` for what a runtime has: a cost model, or a layer profile and layer counts per stage.

    ``source``: a :class:`~stagewise.simulation.CostModel` (then ``partition``, ``latency`` and
    ``bandwidth`` must be left out: the model has them), or a :class:`~stagewise.partition.LayerProfile`
    of one micro-batch with ``partition`` = layers per stage, in stage order (``num_ranks *
    virtual_stages`` counts; ``Pipeline(partition=...)``'s form) and the link's ``latency`` and
    ``bandwidth``. Deterministic: every rank that calls it with the same inputs gets the same schedule.
    """
    if isinstance(source, CostModel):
        if partition is not None or latency != 0.0 or bandwidth != math.inf:
            raise ValueError("synthesize_for: a CostModel already holds its stages and link; pass no partition/link")
        costs = source
    elif isinstance(source, LayerProfile):
        if partition is None:
            raise ValueError("synthesize_for: a LayerProfile needs partition= (layers per stage, in stage order)")
        counts = list(partition)
        if any(not isinstance(c, int) or c < 1 for c in counts) or sum(counts) != len(source):
            raise ValueError(
                f"synthesize_for: partition {counts} must be layer counts >= 1 per stage summing to the "
                f"profile's {len(source)} layers"
            )
        bounds = [0]
        for c in counts:
            bounds.append(bounds[-1] + c)
        costs = source.cost_model(bounds, latency=latency, bandwidth=bandwidth)
    else:
        raise TypeError(f"synthesize_for: source must be a CostModel or a LayerProfile, got {type(source).__name__}")
    return synthesize(
        costs,
        num_ranks,
        microbatches,
        memory=memory,
        memory_bytes=memory_bytes,
        virtual_stages=virtual_stages,
        placement=placement,
    )
