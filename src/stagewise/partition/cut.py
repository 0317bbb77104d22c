"""Partitioning: cut a sequence of layer costs into contiguous stages (pure arithmetic).

The problem is the *linear partition* problem: split costs c_0..c_{n-1} into p
contiguous, non-empty blocks minimising the largest block. We solve it exactly
by dynamic programming over (stage, boundary) (Skiena, *The Algorithm Design
Manual*, 3rd ed., §10.7 "The Partition Problem"), generalised to what pipelines
need:

* per-stage *speed* (HetPipe's heterogeneous devices): block k costs
  ``(sum of its layers + extra_k) / speed_k``, so a rank at half speed gets
  about half the work;
* per-stage *extra* cost (embedding, head, loss on the first/last stage);
* per-stage *memory caps*: a block whose layers' memory exceeds its cap is
  not allowed.

DP: ``best[k][j]`` = the smallest bottleneck for putting layers ``0..j-1`` on
stages ``0..k``; ``best[k][j] = min_i max(best[k-1][i], cost_k(i, j))``. With
prefix sums each cost is O(1), so the whole is O(p·n²) — instant for the tens
to hundreds of blocks of a real model.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Partition:
    """Stage k holds layers ``bounds[k]`` to ``bounds[k+1] - 1``."""

    bounds: tuple[int, ...]
    stage_costs: tuple[float, ...]

    @property
    def counts(self) -> list[int]:
        return [b - a for a, b in zip(self.bounds, self.bounds[1:])]

    @property
    def bottleneck(self) -> float:
        return max(self.stage_costs)

    def stage_of(self, layer: int) -> int:
        for k, (a, b) in enumerate(zip(self.bounds, self.bounds[1:])):
            if a <= layer < b:
                return k
        raise IndexError(f"layer {layer} is outside 0..{self.bounds[-1] - 1}")


def _per_stage(value: float | Sequence[float] | None, p: int, default: float, what: str) -> list[float]:
    if value is None:
        return [default] * p
    if isinstance(value, (int, float)):
        return [float(value)] * p
    values = [float(x) for x in value]
    if len(values) != p:
        raise ValueError(f"partition: {what} has {len(values)} entries, expected one per stage ({p})")
    return values


def partition_costs(
    costs: Sequence[float],
    num_stages: int,
    *,
    speeds: float | Sequence[float] | None = None,
    extra: Sequence[float] | None = None,
    memory: Sequence[float] | None = None,
    memory_caps: float | Sequence[float] | None = None,
) -> Partition:
    """The contiguous partition of ``costs`` into ``num_stages`` non-empty stages with the smallest bottleneck.

    ``speeds[k]`` divides stage k's cost; ``extra[k]`` is added to it before;
    ``memory[i]`` is layer i's memory and ``memory_caps[k]`` what stage k may hold.
    Ties are broken towards putting layers on earlier stages.
    """
    n, p = len(costs), num_stages
    speed, extras, caps = _checked(costs, p, speeds, extra, memory, memory_caps)
    prefix = _prefix_sums(costs)
    mem_prefix = _prefix_sums(memory if memory is not None else [0.0] * n)

    def cost(k: int, i: int, j: int) -> float:
        if mem_prefix[j] - mem_prefix[i] > caps[k]:
            return math.inf
        return (prefix[j] - prefix[i] + extras[k]) / speed[k]

    choice = _best_cuts(n, p, cost)
    if choice is None:
        raise ValueError(_infeasible_reason(n, p, caps, mem_prefix))
    bounds = [n]
    for k in range(p - 1, 0, -1):
        bounds.append(choice[k][bounds[-1]])
    bounds.append(0)
    bounds.reverse()
    stage_costs = tuple(cost(k, bounds[k], bounds[k + 1]) for k in range(p))
    return Partition(bounds=tuple(bounds), stage_costs=stage_costs)


def _checked(
    costs: Sequence[float],
    p: int,
    speeds: float | Sequence[float] | None,
    extra: Sequence[float] | None,
    memory: Sequence[float] | None,
    memory_caps: float | Sequence[float] | None,
) -> tuple[list[float], list[float], list[float]]:
    """The per-stage speeds, extras and memory caps, each input checked (the error names it)."""
    n = len(costs)
    if p < 1:
        raise ValueError(f"partition: need at least 1 stage, got {p}")
    if n < p:
        raise ValueError(f"partition: {p} stages need at least {p} layers, got {n}")
    if any(c < 0 or math.isnan(c) for c in costs):
        raise ValueError("partition: layer costs must be >= 0")
    speed = _per_stage(speeds, p, 1.0, "speeds")
    if any(s <= 0 for s in speed):
        raise ValueError(f"partition: speeds must be > 0, got {speed}")
    extras = _per_stage(extra, p, 0.0, "extra")
    caps = _per_stage(memory_caps, p, math.inf, "memory_caps")
    if memory is not None and len(memory) != n:
        raise ValueError(f"partition: memory has {len(memory)} entries, expected one per layer ({n})")
    return speed, extras, caps


def _prefix_sums(values: Sequence[float]) -> list[float]:
    prefix = [0.0]
    for x in values:
        prefix.append(prefix[-1] + float(x))
    return prefix


def _best_cuts(n: int, p: int, cost: Callable[[int, int, int], float]) -> list[list[int]] | None:
    """The DP of the module docstring: ``choice[k][j]``, where stage k starts when stages 0..k end at layer j;
    None when no partition is feasible (every one has a stage over its memory cap)."""
    inf = math.inf
    best = [[inf] * (n + 1) for _ in range(p)]
    choice = [[0] * (n + 1) for _ in range(p)]
    for j in range(1, n - p + 2):
        best[0][j] = cost(0, 0, j)
    for k in range(1, p):
        for j in range(k + 1, n - (p - k - 1) + 1):
            value, arg = inf, k
            for i in range(k, j):
                prev = best[k - 1][i]
                if prev >= value:
                    continue
                here = max(prev, cost(k, i, j))
                if here < value:
                    value, arg = here, i
            best[k][j], choice[k][j] = value, arg
    return None if best[p - 1][n] == inf else choice


def _infeasible_reason(n: int, p: int, caps: list[float], mem_prefix: list[float]) -> str:
    layer_mem = [mem_prefix[i + 1] - mem_prefix[i] for i in range(n)]
    biggest = max(range(n), key=lambda i: layer_mem[i])
    return (
        f"partition: no split of {n} layers into {p} stages fits the memory caps {caps} "
        f"(total memory {mem_prefix[-1]:g}; the largest layer, {biggest}, needs {layer_mem[biggest]:g})"
    )


def uniform_counts(num_layers: int, num_stages: int) -> list[int]:
    """Layer counts as even as possible, the larger stages first: 10 layers on 4 stages -> [3, 3, 2, 2]."""
    if num_layers < num_stages:
        raise ValueError(f"partition: {num_stages} stages need at least {num_stages} layers, got {num_layers}")
    base, rest = divmod(num_layers, num_stages)
    return [base + (1 if k < rest else 0) for k in range(num_stages)]
