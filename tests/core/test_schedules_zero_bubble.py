"""Zero-bubble schedules (zb-h1, zb-h2, zb-v) and DualPipeV: grid, closed forms, memory, golden text, invariants."""

from __future__ import annotations

from collections import Counter
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import stagewise as sw
from stagewise.ir import Action, ActionRows, Kind
from stagewise.schedules import v_wave
from stagewise.schedules.zero_bubble import _sweep_starts
from stagewise.simulation import CostModel, SimResult, simulate

NAMES = ("zb-h1", "zb-h2", "zb-v", "dualpipe-v")
V_OF = {"zb-h1": 1, "zb-h2": 1, "zb-v": 2, "dualpipe-v": 2}
RANKS = (1, 2, 3, 4, 8)


def microbatch_counts(p: int) -> list[int]:
    return sorted({m for m in (1, 2, 3, p - 1, p, 2 * p, 2 * p + 1, 4 * p) if m >= 1})


GRID = [(p, m, v) for p in RANKS for m in microbatch_counts(p) for v in (1, 2, 3)]


def optimum_v1(p: int, m: int) -> int:
    """Least makespan of any one-stage-per-rank schedule, F = I = W = 1, free transfers.

    Rank p-1 starts at p-1 and has 3m units of work; and the last input
    gradient leaves rank p-1 no earlier than 2m+p-1 (its m forwards and m
    input gradients), then needs p-1 hops back and one W on rank 0.
    """
    return max(3 * m + p - 1, 2 * m + 2 * p - 1)


def exact_bubble(makespan: float, work_per_rank: int) -> Fraction:
    """Idle share of ranks x makespan when every rank has the same work (exact, unlike bubble_ratio)."""
    return 1 - Fraction(work_per_rank) / Fraction(makespan)


# ---- every combination builds, or names its constraint ------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_grid_lowers_validates_and_simulates_or_names_the_constraint(name: str) -> None:
    for p, m, v in GRID:
        if v != V_OF[name]:
            with pytest.raises(ValueError, match=f"needs virtual_stages = {V_OF[name]} per rank, got {v}") as err:
                sw.build_schedule(name, p, m, v)
            assert not isinstance(err.value, sw.ScheduleError)
            continue
        complete = sw.build_schedule(name, p, m, v)  # ScheduleError here = deadlock or channel mismatch
        compute = sw.schedules.generate(name, p, m, v)
        assert complete.compute_only().ranks == compute.ranks
        lowered, raw = simulate(complete), simulate(compute)
        assert lowered.makespan == raw.makespan, (name, p, m)
        assert 0 <= lowered.bubble_ratio < 1


@pytest.mark.parametrize("name", NAMES)
def test_default_virtual_stages_and_microbatch_checks(name: str) -> None:
    assert sw.schedules.generate(name, 3, 4).virtual_stages == V_OF[name]
    with pytest.raises(ValueError, match="at least 1 micro-batch"):
        sw.schedules.generate(name, 3, 0)


# ---- zb-h1 --------------------------------------------------------------------------------


def test_zb_h1_bubble_is_the_v1_optimum_exactly() -> None:
    for p in range(1, 9):
        for m in range(1, 4 * p + 2):
            result = simulate(sw.schedules.generate("zb-h1", p, m))
            assert result.makespan == optimum_v1(p, m), (p, m)
            expected = Fraction(p - 1, 3 * m + p - 1) if m >= p else Fraction(2 * p - 1 - m, 2 * m + 2 * p - 1)
            assert exact_bubble(result.makespan, 3 * m) == expected
            assert result.bubble_ratio == pytest.approx(float(expected), abs=1e-12)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (8, 16), (8, 5)])
def test_zb_h1_lowered_schedule_times_the_same(p: int, m: int) -> None:
    result = simulate(sw.build_schedule("zb-h1", p, m))
    assert result.makespan == optimum_v1(p, m)


def test_zb_h1_memory_is_1f1b_memory() -> None:
    for p in RANKS:
        for m in microbatch_counts(p):
            zb = simulate(sw.schedules.generate("zb-h1", p, m)).peak_activations
            assert zb == [min(p - r, m) for r in range(p)], (p, m)
            assert zb[0] <= simulate(sw.schedules.generate("1f1b", p, m)).peak_activations[0]


def test_zb_h1_golden_text() -> None:
    assert sw.schedules.generate("zb-h1", 2, 3).to_text() == (
        "rank 0: 0F0 0F1 0I0 0W0 0F2 0I1 0W1 0I2 0W2\nrank 1: 1F0 1I0 1F1 1I1 1W0 1F2 1I2 1W1 1W2"
    )
    assert sw.build_schedule("zb-h1", 2, 3).to_text() == (
        "rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0I0 0W0 0RECV_B1 0F2 0SEND_F2 0I1 0W1 0RECV_B2 0I2 0W2 0SYNC\n"
        "rank 1: 1RECV_F0 1F0 1RECV_F1 1I0 1SEND_B0 1F1 1I1 1SEND_B1 1W0 1RECV_F2 1F2 1I2 1SEND_B2 1W1 1W2 1SYNC"
    )


# ---- zb-h2 --------------------------------------------------------------------------------


def idle_between_first_and_last(result: SimResult, rank: int) -> float:
    events = [e for e in result.timeline.by_rank()[rank] if e.action.kind.is_compute]
    return (events[-1].end - events[0].start) - sum(e.duration for e in events)


def test_zb_h2_reaches_the_v1_optimum_and_its_core_has_no_bubble() -> None:
    """With a synchronous flush nothing on one stage per rank beats zb-h1 (see optimum_v1).

    zb-h2's bubble is therefore equal to zb-h1's, but it is all fill: once
    the warm-up is full (m >= 2p-1) rank r works without a gap from time r
    to r + 3m.
    """
    for p in range(1, 9):
        for m in range(1, 4 * p + 2):
            result = simulate(sw.schedules.generate("zb-h2", p, m))
            assert result.makespan == optimum_v1(p, m), (p, m)
            if m >= 2 * p:  # (p-1)/(3m+p-1) <= (p-1)/(7p-1)
                assert result.bubble_ratio < 1 / 7
            if m >= 2 * p - 1:
                for r in range(p):
                    assert idle_between_first_and_last(result, r) == 0, (p, m, r)


def test_zb_h2_memory_is_its_deep_warmup() -> None:
    for p in RANKS:
        for m in microbatch_counts(p):
            peaks = simulate(sw.schedules.generate("zb-h2", p, m)).peak_activations
            assert peaks == [min(m, 2 * p - 1 - 2 * r) for r in range(p)], (p, m)


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_zb_h2_absorbs_transfer_time_better_than_zb_h1(p: int) -> None:
    for m in (2 * p, 2 * p + 1, 4 * p):
        costs = CostModel.uniform(p, comm_time=1.0)
        h2 = simulate(sw.build_schedule("zb-h2", p, m), costs).bubble_ratio
        h1 = simulate(sw.build_schedule("zb-h1", p, m), costs).bubble_ratio
        assert h2 < h1, (p, m, h2, h1)


# ---- zb-v and dualpipe-v ------------------------------------------------------------------


@pytest.mark.parametrize("name", ["zb-v", "dualpipe-v"])
def test_v_schedules_makespan_closed_form(name: str) -> None:
    for p in range(1, 9):
        for m in range(1, 4 * p + 2):
            makespan = simulate(sw.schedules.generate(name, p, m)).makespan
            if m >= p:  # the optimum: rank p-1 starts at p-1 and has 6m units of work
                assert makespan == 6 * m + p - 1, (name, p, m)
                assert exact_bubble(makespan, 6 * m) == Fraction(p - 1, 6 * m + p - 1)
            else:  # the last micro-batch enters at m-1 or later, then 4p units in a row and a W
                assert max(6 * m + p - 1, 4 * p + m) <= makespan <= 4 * p + 4 * m, (name, p, m)


@pytest.mark.parametrize("name", ["zb-v", "dualpipe-v"])
def test_v_schedules_bubble_is_small_once_m_is_2p(name: str) -> None:
    """(p-1)/(6m+p-1) < 1/13 for m >= 2p: about half of zb-h1's, and the least a synchronous V can do."""
    for p in RANKS:
        for m in (2 * p, 2 * p + 1, 3 * p + 1, 4 * p):
            result = simulate(sw.build_schedule(name, p, m))
            assert result.bubble_ratio < 1 / 13
            assert result.bubble_ratio <= simulate(sw.schedules.generate("zb-h1", p, m)).bubble_ratio


def test_zb_v_memory_is_1f1b_memory() -> None:
    for p in RANKS:
        for m in microbatch_counts(p):
            zb_v = simulate(sw.schedules.generate("zb-v", p, m)).peak_activations
            assert max(zb_v) == min(p, m) == simulate(sw.schedules.generate("1f1b", p, m)).peak_activations[0], (p, m)


def test_dualpipe_v_keeps_one_more_microbatch_in_flight() -> None:
    for p in RANKS:
        for m in microbatch_counts(p):
            assert max(simulate(sw.schedules.generate("dualpipe-v", p, m)).peak_activations) == min(p + 1, m), (p, m)


@pytest.mark.parametrize("warmup", [0, 1, 3, 4, 5])
def test_v_wave_plan_has_zero_slack(warmup: int) -> None:
    """The plan behind zb-v and dualpipe-v (why they cannot deadlock): see zero_bubble.v_wave."""
    for p, m in [(1, 3), (2, 5), (3, 7), (4, 9), (5, 13), (4, 2)]:
        f0, i1, f1, i0 = _sweep_starts(p, m, min(warmup, m))
        for down in (f0, i1):
            assert all(t % 2 == 0 for t in down)
        for up in (f1, i0):
            assert all(t % 2 == p % 2 for t in up)
        assert len(set(f0) | set(i1)) == len(set(f1) | set(i0)) == 2 * m  # one sweep per start time
        for k in range(m):  # each sweep starts once the previous one has crossed all p ranks
            assert f1[k] >= f0[k] + p and i1[k] >= f1[k] + p and i0[k] >= i1[k] + p


def _plain_rank_order(p: int, r: int, start: list[list[int]]) -> list[Action]:
    """The V wave's rank order spelled out time unit by time unit (the reference for the column generator):
    each sweep's action at its time, and in every free unit the oldest W whose I has run."""
    down, up = r, 2 * p - 1 - r
    size = max(start[3][-1] + p - r, start[1][-1] + r + 1)
    slot: list[Action | None] = [None] * size
    owed: list[Action | None] = [None] * size
    sweeps = ((0, down, Kind.F, r, None), (1, up, Kind.I, r, up), (2, up, Kind.F, p - 1 - r, None))
    for sweep, stage, kind, shift, w_stage in (*sweeps, (3, down, Kind.I, p - 1 - r, down)):
        for k, origin in enumerate(start[sweep]):
            assert slot[origin + shift] is None
            slot[origin + shift] = Action(stage, kind, k)
            if w_stage is not None:
                owed[origin + shift] = Action(w_stage, Kind.W, k)
    order: list[Action] = []
    pending: list[Action] = []
    for action, w in zip(slot, owed, strict=True):
        if action is None:
            if pending:
                order.append(pending.pop(0))
        else:
            order.append(action)
            if w is not None:
                pending.append(w)
    return order + pending


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 7, 8])
def test_v_wave_columns_equal_the_plain_order(p: int) -> None:
    """v_wave computes the orders as arrays (W slots by a running maximum); the plain walk gives the same."""
    for m in [1, 2, p - 1, p, p + 1, 2 * p + 3, 17]:
        if m < 1:
            continue
        for warmup in {0, 1, p - 1, p, 2 * p}:
            start = _sweep_starts(p, m, min(warmup, m))
            rows = v_wave(p, m, warmup)
            assert isinstance(rows, ActionRows)
            assert tuple(rows) == tuple(tuple(_plain_rank_order(p, r, start)) for r in range(p)), (p, m, warmup)


def test_zb_v_golden_text() -> None:
    assert sw.schedules.generate("zb-v", 2, 3).to_text() == (
        "rank 0: 0F0 0F1 3F0 3I0 3F1 3W0 0I0 0F2 0W0 3I1 3F2 3I2 0I1 3W1 0I2 3W2 0W1 0W2\n"
        "rank 1: 1F0 2F0 1F1 2F1 2I0 1I0 2W0 1W0 1F2 2F2 2I1 1I1 2I2 1I2 2W1 1W1 2W2 1W2"
    )


# ---- p=4, m=8 and p=8, m=16 against 1F1B -------------------------------------------------


@pytest.mark.parametrize("p,m", [(4, 8), (8, 16)])
def test_reported_cases(p: int, m: int) -> None:
    bubble = {name: simulate(sw.build_schedule(name, p, m)).bubble_ratio for name in ("1f1b", *NAMES)}
    assert bubble["1f1b"] == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
    assert bubble["zb-h1"] == pytest.approx(bubble["zb-h2"], abs=1e-12)
    assert bubble["zb-h1"] == pytest.approx((p - 1) / (3 * m + p - 1), abs=1e-12)
    assert bubble["zb-v"] == pytest.approx(bubble["dualpipe-v"], abs=1e-12)
    assert bubble["zb-v"] == pytest.approx((p - 1) / (6 * m + p - 1), abs=1e-12)


# ---- invariants on random sizes -----------------------------------------------------------


MEMORY_BOUND = {
    "zb-h1": lambda p, m: min(p, m),
    "zb-h2": lambda p, m: min(2 * p - 1, m),
    "zb-v": lambda p, m: min(p, m),
    "dualpipe-v": lambda p, m: min(p + 1, m),
}


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(NAMES), p=st.integers(1, 6), m=st.integers(1, 26))
def test_invariants(name: str, p: int, m: int) -> None:
    schedule = sw.schedules.generate(name, p, m)
    assert schedule.ranks == sw.schedules.generate(name, p, m).ranks  # a pure function of (p, m, v)
    # each stage runs F, I, W once per micro-batch, each kind in micro-batch order, on its own rank
    for rank, acts in enumerate(schedule.ranks):
        per_kind = m * V_OF[name]
        assert Counter(a.kind for a in acts) == {Kind.F: per_kind, Kind.I: per_kind, Kind.W: per_kind}
        for stage in schedule.stages_of(rank):
            for kind in (Kind.F, Kind.I, Kind.W):
                assert [a.microbatch for a in acts if a.stage == stage and a.kind is kind] == list(range(m))
        assert {a.stage for a in acts} == set(schedule.stages_of(rank))
    sw.build_schedule(name, p, m)  # lowers and validates: no deadlock, channels agree
    result = simulate(schedule)
    work = 3 * m * V_OF[name]
    assert result.makespan >= work + p - 1
    assert max(result.peak_activations) <= MEMORY_BOUND[name](p, m)
    assert 0 <= result.bubble_ratio < 1
