"""Synthesized schedules (issue 35) run by the runtime: two float64 train steps equal the one-process model.

Each check synthesizes its schedule on every rank from the same costs (synthesis is deterministic), passes
the :class:`~stagewise.Schedule` object to ``sw.Pipeline``, and compares loss and gradients with
``sw.build_model`` (``runtime_checks.parity``). The costs are uneven on purpose (stage forwards of 1, 1.5 and
2, I : W = 3 : 1, a latency of 0.7), so that the orders differ from every registered schedule's (but at m = 1).
"""

from __future__ import annotations

from dataclasses import replace

from runtime_checks import parity
from stagewise.ir import Schedule
from stagewise.passes import split_backward
from stagewise.schedules import generate, schedule_names
from stagewise.simulation import CostModel
from stagewise.synthesis import synthesize
from worker import Check


def _costs(n: int, latency: float) -> CostModel:
    """Stage costs that no hand-written schedule assumes: uneven F, I : W = 3 : 1, a latency."""
    base = CostModel.uniform(n, weight_activation_bytes=1 / 3)
    forward = tuple(1.0 + 0.5 * (s % 3) for s in range(n))
    return replace(
        base,
        forward=forward,
        backward_input=tuple(1.5 * f for f in forward),
        backward_weight=tuple(0.5 * f for f in forward),
        latency=latency,
    )


def auto(
    p: int, m: int, *, v: int = 1, placement: str | None = None, factor: int = 1, latency: float = 0.7
) -> Schedule:
    return synthesize(_costs(p * v, latency), p, m, memory=factor * min(p, m), virtual_stages=v, placement=placement)


def registered_twin(schedule: Schedule) -> str | None:
    """The registered schedule whose compute order (each B as I then W) equals ``schedule``'s, if any."""
    mine = _split(schedule)
    for name in schedule_names(synchronous=True):
        try:
            other = generate(name, schedule.num_ranks, schedule.num_microbatches, schedule.virtual_stages)
        except ValueError:
            continue
        if other.placement == schedule.placement and _split(other) == mine:
            return name
    return None


def _split(schedule: Schedule) -> list[list[str]]:
    return [list(map(str, acts)) for acts in split_backward(schedule.compute_only()).ranks]


def checks(world: int) -> dict[str, Check]:
    p = world
    cases = {
        f"mlp-auto-m{2 * p + 1}": ("mlp", lambda w: auto(w, 2 * w + 1), 2 * p + 1),
        f"lm-auto-m{p + 1}": ("lm", lambda w: auto(w, w + 1), p + 1),
        "mlp-auto-m1": ("mlp", lambda w: auto(w, 1), 1),
        f"mlp-auto-v2-m{p + 1}": ("mlp", lambda w: auto(w, w + 1, v=2), p + 1),
        f"mlp-auto-v2-twice-1f1b-memory-m{p + 1}": ("mlp", lambda w: auto(w, w + 1, v=2, factor=2), p + 1),
        f"lm-auto-v2-loop-m{p}": ("lm", lambda w: auto(w, w, v=2, placement="loop"), p),
    }
    return {name: parity(model, make, m) for name, (model, make, m) in cases.items()}
