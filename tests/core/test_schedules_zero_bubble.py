"""Zero-bubble schedules (zb-h1, zb-h2, zb-v) and DualPipeV: grid, closed forms, memory, golden text, invariants."""

from __future__ import annotations

from collections import Counter
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import stagewise as sw
from stagewise.ir import Kind
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


def test_zb_h2_transfer_closed_form() -> None:
    """The table's transfer column: a transfer time c <= F adds 2(p-1)c for m <= p and only (p-1)c once
    m >= 2p-1 (the deep warm-up leaves one way of every round trip in slack)."""
    for p in range(2, 9):
        for m in [*range(1, p + 1), *range(2 * p - 1, 3 * p + 2)]:
            compute = sw.schedules.generate("zb-h2", p, m)
            free = simulate(compute).makespan
            hops = 2 * (p - 1) if m <= p else p - 1
            for c in (0.125, 0.5, 1.0):
                assert simulate(compute, CostModel.uniform(p, comm_time=c)).makespan == pytest.approx(free + hops * c)


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


def zb_v_makespan(p: int, m: int) -> int:
    """zb-v with F = I = W = 1 and free transfers (see its docstring)."""
    if m <= p:
        return 4 * p + 3 * m - 2 + max(0, m - p // 2)
    return max(6 * m + p - 1, 4 * m + 4 * p - 2)


@pytest.mark.parametrize("name", ["zb-v", "dualpipe-v"])
def test_v_schedules_makespan_closed_form(name: str) -> None:
    for p in range(1, 13):
        for m in range(1, 4 * p + 2):
            makespan = simulate(sw.schedules.generate(name, p, m)).makespan
            if name == "zb-v" or m < 2 * p:
                assert makespan == zb_v_makespan(p, m), (name, p, m)
            else:
                assert makespan == 6 * m + p - 1, (name, p, m)
            if 2 * m >= 3 * p - 1:  # the optimum: rank p-1 starts at p-1 and has 6m units of work
                assert makespan == 6 * m + p - 1, (name, p, m)
                assert exact_bubble(makespan, 6 * m) == Fraction(p - 1, 6 * m + p - 1)


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


def test_dualpipe_v_holds_one_more_stage_activation() -> None:
    for p in RANKS:
        for m in microbatch_counts(p):
            peak = max(simulate(sw.schedules.generate("dualpipe-v", p, m)).peak_activations)
            assert peak == (p + 0.5 if m >= 2 * p else min(p, m)), (p, m)


def test_dualpipe_v_below_2p_microbatches_is_zb_v() -> None:
    for p in RANKS:
        for m in range(1, 2 * p):
            assert sw.schedules.generate("dualpipe-v", p, m).ranks == sw.schedules.generate("zb-v", p, m).ranks


@pytest.mark.parametrize("name", ["zb-v", "dualpipe-v"])
def test_v_schedules_absorb_transfer_time(name: str) -> None:
    """With a transfer of one forward, once m >= 2p the V loses the same few units however large m is: the
    transfers of the fill and the drain, under 5(p-1). (An order that uses each value the moment it is made
    pays transfers on its critical path for every micro-batch.)"""
    for p in (2, 3, 4, 8):
        lost = set()
        for m in (2 * p, 4 * p, 8 * p):
            free = simulate(sw.schedules.generate(name, p, m)).makespan
            slow = simulate(sw.schedules.generate(name, p, m), CostModel.uniform(2 * p, comm_time=1.0)).makespan
            lost.add(slow - free)
        assert len(lost) == 1 and lost.pop() < 5 * (p - 1), (name, p)


def test_zb_v_drain_lets_weights_trail_by_rank() -> None:
    """For m <= p, after its last forward rank r runs its input gradients with each W right after an I that
    leaves more than r owed, the rest of the W passes after the last I (oldest first, as everywhere)."""
    for p in (2, 3, 5, 8):
        for m in range(1, p + 1):
            for r, acts in enumerate(sw.schedules.generate("zb-v", p, m).ranks):
                last_f = max(j for j, a in enumerate(acts) if a.kind is Kind.F)
                head, tail = acts[: last_f + 1], acts[last_f + 1 :]
                owed = sum(a.kind is Kind.I for a in head) - sum(a.kind is Kind.W for a in head)
                last_i = max(j for j, a in enumerate(tail) if a.kind is Kind.I)
                for j, a in enumerate(tail):
                    if a.kind is Kind.I:
                        owed += 1
                        follows_w = j + 1 < len(tail) and tail[j + 1].kind is Kind.W
                        assert follows_w == (owed > r or j == last_i), (p, m, r, j)
                    else:
                        assert a.kind is Kind.W and (tail[j - 1].kind is Kind.I or j > last_i), (p, m, r, j)
                        owed -= 1
                assert owed == 0


def test_zb_v_golden_text() -> None:
    assert sw.schedules.generate("zb-v", 2, 3).to_text() == (
        "rank 0: 0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0I0 0W0 3F2 3I2 3W2 0I1 0W1 0I2 0W2\n"
        "rank 1: 1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1I1 2I2 1I2 1W1 2W2 1W2"
    )
    assert sw.schedules.generate("zb-v", 2, 2).to_text() == (
        "rank 0: 0F0 0F1 3F0 3I0 3W0 3F1 3I1 3W1 0I0 0W0 0I1 0W1\n"
        "rank 1: 1F0 2F0 1F1 2F1 2I0 1I0 2W0 2I1 1W0 1I1 2W1 1W1"
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
    "dualpipe-v": lambda p, m: p + 0.5 if m >= 2 * p else min(p, m),
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
