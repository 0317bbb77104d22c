"""The synthesizer's lower bound: closed forms, and never above the best of every valid schedule (brute force)."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stagewise.simulation import CostModel
from stagewise.synthesis import lower_bound, synthesize
from stagewise.synthesis.orders import Instance
from stagewise.synthesis.problem import make_problem


def optimum_v1(p: int, m: int) -> int:
    """zb-h1's makespan with F = I = W = 1 and free transfers (tests/core/test_schedules_zero_bubble.py)."""
    return max(3 * m + p - 1, 2 * m + 2 * p - 1)


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8, 16])
def test_uniform_bound_is_zb_h1s_makespan(p: int, m: int) -> None:
    """With uniform costs the bound is exactly the optimum zb-h1 reaches, so both are tight."""
    assert lower_bound(CostModel.uniform(p), p, m) == optimum_v1(p, m)


def test_latency_enters_the_head_of_the_last_rank() -> None:
    """Rank p-1 cannot start before p-1 forwards and p-1 transfers: 3m + (p-1)(1 + c)."""
    p, m, c = 4, 8, 0.25
    assert lower_bound(CostModel.uniform(p, comm_time=c), p, m) == pytest.approx(3 * m + (p - 1) * (1 + c))


def _orders_of_rank(inst: Instance, rank: int) -> list[list[int]]:
    """Every order of a rank's actions with F before I before W of a (stage, micro-batch), and a micro-batch's
    forwards (backwards) over the rank's stages in (reverse) stage order: all a valid schedule can run."""
    prob, m = inst.problem, inst.m
    local = prob.stages_of(rank)
    before: dict[int, set[int]] = {}
    for i in range(m):
        for k, s in enumerate(local):
            f, b, w = (3 * (s * m + i) + j for j in range(3))
            before[f] = {3 * (local[k - 1] * m + i)} if k else set()
            before[b] = {f} | ({3 * (local[k + 1] * m + i) + 1} if k + 1 < len(local) else set())
            before[w] = {b}
    out: list[list[int]] = []

    def extend(order: list[int], left: set[int]) -> None:
        if not left:
            out.append(list(order))
            return
        for code in sorted(left):
            if before[code].isdisjoint(left):
                order.append(code)
                extend(order, left - {code})
                order.pop()

    extend([], set(before))
    return out


def brute_force_optimum(costs: CostModel, p: int, m: int, v: int, placement: str) -> float:
    """The least makespan over every combination of valid per-rank orders (those that can finish)."""
    prob = make_problem(costs, p, m, memory=math.inf, memory_bytes=None, virtual_stages=v, placement=placement)
    inst = Instance(prob)
    per_rank = [_orders_of_rank(inst, r) for r in range(p)]
    best = math.inf
    for combo in itertools.product(*per_rank):
        ms = inst.makespan(list(combo))
        if ms is not None:
            best = min(best, ms)
    return best


_TIMES = st.sampled_from([0.0, 0.5, 1.0, 1.5, 2.0, 3.0])
_SHAPES = st.sampled_from(
    [(1, 1, 1, "loop"), (1, 3, 1, "loop"), (2, 1, 1, "loop"), (2, 2, 1, "loop"), (3, 1, 1, "loop"), (3, 2, 1, "loop")]
    + [(1, 2, 2, "v"), (2, 1, 2, "v"), (2, 1, 2, "loop"), (1, 1, 3, "loop")]
)


@settings(max_examples=40, deadline=None)
@given(shape=_SHAPES, data=st.data(), latency=st.sampled_from([0.0, 0.25, 1.0]))
def test_bound_never_exceeds_the_best_valid_schedule(shape: tuple[int, int, int, str], data, latency: float) -> None:
    """Random small cost models: the bound <= the optimum found by trying every valid schedule <= synthesized."""
    p, m, v, placement = shape
    n = p * v
    rows = [(data.draw(_TIMES), data.draw(_TIMES), data.draw(_TIMES)) for _ in range(n)]
    costs = CostModel(
        num_stages=n,
        forward=tuple(r[0] for r in rows),
        backward_input=tuple(r[1] for r in rows),
        backward_weight=tuple(r[2] for r in rows),
        activation_bytes=(1.0,) * n,
        weight_activation_bytes=(0.5,) * n,
        parameter_bytes=(0.0,) * n,
        output_bytes=(0.0,) * n,
        latency=latency,
    )
    best = brute_force_optimum(costs, p, m, v, placement)
    bound = lower_bound(costs, p, m, virtual_stages=v, placement=placement)
    assert bound <= best + 1e-9, (rows, bound, best)
    found = synthesize(costs, p, m, memory=math.inf, virtual_stages=v, placement=placement)
    assert found.meta["synthesis"]["makespan"] >= best - 1e-9
    assert found.meta["synthesis"]["lower_bound"] == bound


def test_brute_force_finds_the_known_optimum() -> None:
    """The oracle itself: with uniform costs it finds zb-h1's makespan, the optimum."""
    for p, m in [(2, 2), (3, 2)]:
        assert brute_force_optimum(CostModel.uniform(p), p, m, 1, "loop") == optimum_v1(p, m)
