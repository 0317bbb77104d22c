"""What a synthesis is asked: costs, ranks, micro-batches, stages per rank, placement, memory caps; checked once.

Every refusal names what is wrong and what would work: a cost model of the wrong shape names the stage that
has no costs (or no rank), a memory cap nothing fits names the rank and the smallest cap that works.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from .._util import is_count
from ..ir import loop_placement, v_placement
from ..simulation import CostModel

#: (forward, backward_input, backward_weight[, backward]) of one stage, the short form of a cost model
StageTimes = tuple[float, ...]


@dataclass(frozen=True)
class MemoryLimit:
    """One way of counting activation memory, with a cap per rank.

    An F of stage s adds ``add[s]``; its I leaves ``keep[s]`` in its place (W's stash, which can be more), which
    its W frees; a B frees ``add[s]``. ``unit`` names the count in messages ("micro-batches" or "bytes").
    """

    unit: str
    add: tuple[float, ...]
    keep: tuple[float, ...]
    caps: tuple[float, ...]


@dataclass(frozen=True)
class Problem:
    """The checked inputs of one synthesis.

    ``costs`` are the costs as given, which the result is timed with. A search may run some stages' backward
    whole (``fused``): it then times their I as B and their W as free, and their I frees all
    (:func:`with_fused`); ``search_costs`` is that cost model.
    """

    costs: CostModel
    num_ranks: int
    microbatches: int
    virtual_stages: int
    placement_kind: str  # "loop" or "v"
    placement: tuple[int, ...]
    limits: tuple[MemoryLimit, ...]
    fused: frozenset[int] = frozenset()
    timed: CostModel | None = None  # the costs with the fused stages' backward whole (None: none fused)

    @property
    def num_stages(self) -> int:
        return len(self.placement)

    @property
    def search_costs(self) -> CostModel:
        """The costs the search times its orders with: ``costs``, the ``fused`` stages' I costing B, W nothing."""
        return self.costs if self.timed is None else self.timed

    def stages_of(self, rank: int) -> tuple[int, ...]:
        return tuple(s for s, r in enumerate(self.placement) if r == rank)


def as_cost_model(costs: CostModel | Sequence[Sequence[float]], num_stages: int) -> CostModel:
    """A :class:`CostModel` for ``num_stages`` stages, or a ValueError naming the stage that does not fit.

    ``costs`` is a cost model, or one ``(forward, backward_input, backward_weight)`` per stage, or
    ``(forward, backward_input, backward_weight, backward)`` with the full backward B measured (free
    transfers; every activation counts one micro-batch, half of it kept for W).
    """
    if isinstance(costs, CostModel):
        if costs.num_stages < num_stages:
            missing = ", ".join(map(str, range(costs.num_stages, num_stages)))
            raise ValueError(
                f"synthesize: the cost model describes {costs.num_stages} stages, {num_stages} are needed: "
                f"stage(s) {missing} have no costs"
            )
        if costs.num_stages > num_stages:
            raise ValueError(
                f"synthesize: the cost model describes {costs.num_stages} stages, but only {num_stages} are placed "
                f"(ranks x virtual stages): stage {num_stages} has no rank"
            )
        return costs
    rows = list(costs)
    if len(rows) != num_stages:
        raise ValueError(
            f"synthesize: {len(rows)} stage cost rows for {num_stages} stages (ranks x virtual stages): "
            + (f"stage {len(rows)} has no costs" if len(rows) < num_stages else f"stage {num_stages} has no rank")
        )
    times: list[StageTimes] = []
    for s, row in enumerate(rows):
        values = list(row) if isinstance(row, Sequence) and not isinstance(row, str) else [row]
        if len(values) not in (3, 4) or not all(_is_time(x) for x in values):
            raise ValueError(
                f"synthesize: stage {s} costs {row!r}; expected (forward, backward_input, backward_weight), "
                "three finite times >= 0 (and optionally the full backward's, fourth)"
            )
        times.append(tuple(float(x) for x in values))
    full = tuple(t[3] if len(t) == 4 else t[1] + t[2] for t in times)
    return CostModel(
        num_stages=num_stages,
        forward=tuple(t[0] for t in times),
        backward_input=tuple(t[1] for t in times),
        backward_weight=tuple(t[2] for t in times),
        activation_bytes=(1.0,) * num_stages,
        weight_activation_bytes=(0.5,) * num_stages,
        parameter_bytes=(0.0,) * num_stages,
        output_bytes=(0.0,) * num_stages,
        backward_full=full if any(len(t) == 4 for t in times) else (),
    )


def _is_time(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x < math.inf


def make_problem(
    costs: CostModel | Sequence[Sequence[float]],
    num_ranks: int,
    microbatches: int,
    *,
    memory: float | Sequence[float] | None,
    memory_bytes: float | Sequence[float] | None,
    virtual_stages: int,
    placement: str | None,
) -> Problem:
    """Check every input; the caps default to 1F1B's peak, min(p, m) micro-batches on every rank."""
    if not is_count(num_ranks):
        raise ValueError(f"synthesize: num_ranks must be an int >= 1, got {num_ranks!r}")
    if not is_count(microbatches):
        raise ValueError(f"synthesize: microbatches must be an int >= 1, got {microbatches!r}")
    if not is_count(virtual_stages):
        raise ValueError(f"synthesize: virtual_stages must be an int >= 1, got {virtual_stages!r}")
    kind = placement if placement is not None else ("v" if virtual_stages == 2 else "loop")
    if kind not in ("loop", "v"):
        raise ValueError(f"synthesize: placement must be 'loop' or 'v', got {placement!r}")
    if kind == "v" and virtual_stages < 2:
        raise ValueError(
            "synthesize: placement 'v' zig-zags two or more stages per rank; with virtual_stages=1 it is the loop: "
            "give virtual_stages=2 (as zb-v)"
        )
    p, v = num_ranks, virtual_stages
    plc = loop_placement(p, v) if kind == "loop" else v_placement(p, v)
    model = as_cost_model(costs, len(plc))
    if memory is None and memory_bytes is None:
        memory = float(min(p, microbatches))
    limits = []
    if memory is not None:
        limits.append(_micro_batch_limit(model, plc, v, _caps(memory, p, "memory")))
    if memory_bytes is not None:
        add = tuple(model.activation_bytes)
        keep = tuple(model.weight_activation_bytes)
        limits.append(MemoryLimit("bytes", add, keep, _caps(memory_bytes, p, "memory_bytes")))
    problem = Problem(model, p, microbatches, v, kind, plc, tuple(limits))
    for limit in problem.limits:
        _check_fits(problem, limit)
    return problem


def _micro_batch_limit(model: CostModel, plc: tuple[int, ...], v: int, caps: tuple[float, ...]) -> MemoryLimit:
    """Micro-batch units: a stage's activations count 1/v, what W keeps its share of the bytes (the simulator's
    ``weight_activation_bytes`` over ``activation_bytes``; nothing when the model has no activation bytes)."""
    add = tuple(1.0 / v for _ in plc)
    keep = tuple((k / a if a > 0 else 0.0) / v for k, a in zip(model.weight_activation_bytes, model.activation_bytes))
    return MemoryLimit("micro-batches", add, keep, caps)


def _caps(value: float | Sequence[float], p: int, what: str) -> tuple[float, ...]:
    values = [value] * p if isinstance(value, (int, float)) else list(value)
    if len(values) != p:
        raise ValueError(f"synthesize: {what} has {len(values)} caps, expected one per rank ({p}) or one for all")
    bad = [(r, x) for r, x in enumerate(values) if isinstance(x, bool) or not isinstance(x, (int, float)) or not x > 0]
    if bad:
        raise ValueError(f"synthesize: {what} cap of rank {bad[0][0]} must be a number > 0, got {bad[0][1]!r}")
    return tuple(float(x) for x in values)


def smallest_caps(problem: Problem, limit: MemoryLimit) -> list[float]:
    """Per rank, the least cap any schedule fits: one micro-batch through all of the rank's stages at once.

    A micro-batch's activations on a rank's stages nest (its F of the later stage runs before the I of the
    earlier one), so every schedule holds them all at some point, and, at the end of each I, W's stash
    beside the activations of the rank's stages below; running the micro-batches one at a time, each W
    right after its I, holds no more than that, so the figure is exact.
    """
    need = [0.0] * problem.num_ranks
    for r in range(problem.num_ranks):
        below = 0.0
        for s in problem.stages_of(r):
            need[r] = max(need[r], below + limit.keep[s])
            below += limit.add[s]
        need[r] = max(need[r], below)
    return need


def _check_fits(problem: Problem, limit: MemoryLimit) -> None:
    need = smallest_caps(problem, limit)
    short = [r for r in range(problem.num_ranks) if limit.caps[r] < need[r] * (1 - 1e-12)]
    if short:
        r = short[0]
        smallest = max(need)
        raise ValueError(
            f"synthesize: a memory cap of {limit.caps[r]:g} {limit.unit} on rank {r} fits no schedule: one "
            f"micro-batch alone holds {need[r]:g} {limit.unit} there (the activations of all its stages at once); "
            f"the smallest cap that works is {smallest:g} {limit.unit}"
            + ("" if len(set(need)) == 1 else f" (per rank: {', '.join(f'{x:g}' for x in need)})")
        )


def with_fused(base: Problem, stages: frozenset[int]) -> Problem:
    """``base`` (a problem with nothing fused) searched with the backward of ``stages`` whole: their I costs B and
    frees all, their W costs nothing and frees nothing (an I followed by its free W is a B:
    :func:`~.orders.to_actions` writes it so)."""
    assert not base.fused, "with_fused takes the problem as made, nothing fused yet"
    if not stages:
        return base
    c = base.costs
    full = c.backward_times()
    timed = replace(
        c,
        backward_input=tuple(full[s] if s in stages else x for s, x in enumerate(c.backward_input)),
        backward_weight=tuple(0.0 if s in stages else x for s, x in enumerate(c.backward_weight)),
        weight_activation_bytes=tuple(0.0 if s in stages else x for s, x in enumerate(c.weight_activation_bytes)),
    )
    limits = tuple(
        replace(lim, keep=tuple(0.0 if s in stages else k for s, k in enumerate(lim.keep))) for lim in base.limits
    )
    return replace(base, fused=frozenset(stages), timed=timed, limits=limits)
