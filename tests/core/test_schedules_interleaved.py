"""Virtual-stage schedules (interleaved-1f1b, looped-bfs): grid, closed forms, memory, golden text, invariants."""

from __future__ import annotations

from collections import Counter
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import stagewise as sw
from stagewise.ir import Action, ActionRows, Kind, Schedule, loop_placement
from stagewise.passes import lower
from stagewise.simulation import CostModel, simulate
from stagewise.validate import ScheduleError, validate_schedule

NAMES = ("interleaved-1f1b", "looped-bfs")
RANKS = (1, 2, 3, 4, 8)


def microbatch_groups(p: int, m: int) -> list[int]:
    # Imported late, after the registry has loaded every built-in module in its own order: importing
    # the module first would register these schedules ahead of the others and reorder schedule_names().
    sw.schedule_names()
    from stagewise.schedules import microbatch_groups as groups

    return groups(p, m)


def microbatch_counts(p: int) -> list[int]:
    return sorted({m for m in (1, 2, 3, p - 1, p, 2 * p, 2 * p + 1, 4 * p) if m >= 1})


GRID = [(p, m, v) for p in RANKS for m in microbatch_counts(p) for v in (1, 2, 3)]


def refused(name: str, p: int, m: int, v: int) -> bool:
    """Every (p, m, v) is served: the communication pass posts receives once their value exists."""
    return False


def order(name: str, p: int, m: int, v: int) -> Schedule:
    """The generator's compute-only order, without the registry's check (the orders hold for every m)."""
    ranks = sw.schedule_info(name).generator(p, m, v)
    return Schedule(name, m, loop_placement(p, v), tuple(tuple(acts) for acts in ranks))


def optimum(p: int, m: int, v: int) -> int:
    """Least makespan with a stage's F = 1 and B = 2: rank p-1 starts at p-1 and has 3vm units of work,
    the last stage starts at vp-1 and has 3m; then their last backward goes back to stage 0, 2 units a stage."""
    return 3 * max(v * m + p - 1, v * p + m - 1)


def expected_bubble(p: int, m: int, v: int) -> Fraction:
    if m >= p:
        return Fraction(p - 1, v * m + p - 1)
    return Fraction(v * p - 1 - (v - 1) * m, v * p + m - 1)


# ---- every combination builds, or names its constraint ------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_grid_lowers_validates_and_simulates_or_names_the_constraint(name: str) -> None:
    for p, m, v in GRID:
        if refused(name, p, m, v):
            with pytest.raises(ValueError, match=f"does not support {p} ranks x {m} micro-batches") as err:
                sw.build_schedule(name, p, m, v)
            assert not isinstance(err.value, ScheduleError)
            continue
        complete = sw.build_schedule(name, p, m, v)  # ScheduleError here = deadlock or channel mismatch
        compute = sw.schedules.generate(name, p, m, v)
        assert complete.compute_only().ranks == compute.ranks
        lowered, raw = simulate(complete), simulate(compute)
        assert lowered.makespan == raw.makespan == optimum(p, m, v), (name, p, m, v)
        assert 0 <= lowered.bubble_ratio < 1


@pytest.mark.parametrize("name", NAMES)
def test_default_virtual_stages_is_two_and_any_v_is_allowed(name: str) -> None:
    assert sw.schedules.generate(name, 3, 2).virtual_stages == 2
    assert sw.schedules.generate(name, 3, 2, 5).virtual_stages == 5
    assert sw.schedule_info(name).virtual_stages is None
    with pytest.raises(ValueError, match="at least 1 micro-batch"):
        sw.schedules.generate(name, 3, 0)


@pytest.mark.parametrize("name", NAMES)
def test_every_order_lowers_without_deadlock(name: str) -> None:
    """Looped orders used to deadlock when receives sat right before their consumer; they must all lower."""
    for p in (2, 3, 4, 5):
        for v in (2, 3):
            for m in range(1, 3 * p + 1):
                schedule = order(name, p, m, v)
                if refused(name, p, m, v):
                    with pytest.raises(ScheduleError, match="deadlock|channel"):
                        lower(schedule)
                else:
                    lower(schedule)


# ---- closed forms -------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_makespan_and_bubble_are_exact_for_every_m(name: str) -> None:
    """Both reach the least makespan; the bubble is (p-1)/(vm+p-1) for every m >= p, not only multiples."""
    for p in (1, 2, 3, 4, 5, 8):
        for v in range(1, 5):
            for m in range(1, 3 * p + 2):
                schedule = order(name, p, m, v)
                validate_schedule(schedule)  # compute-only: every order is dataflow-correct, limit or not
                result = simulate(schedule, CostModel.uniform(p * v))
                assert result.makespan == optimum(p, m, v), (p, m, v)
                work = 3 * v * m  # per rank: v*m forwards of 1 and backwards of 2
                assert 1 - Fraction(work) / Fraction(result.makespan) == expected_bubble(p, m, v)
                assert result.bubble_ratio == pytest.approx(float(expected_bubble(p, m, v)), abs=1e-12)


@pytest.mark.parametrize("p,v", [(2, 2), (4, 2), (4, 3), (8, 2), (8, 4)])
def test_interleaving_divides_the_1f1b_bubble_time_by_v(p: int, v: int) -> None:
    """A model cut into v*p stages of 1/v the cost: the idle time is 1F1B's 3(p-1), divided by v."""
    chunk = CostModel.uniform(p * v, forward=1 / v, backward_input=1 / v, backward_weight=1 / v)
    for m in (p, 2 * p, 3 * p + 1):
        one_f_one_b = simulate(sw.schedules.generate("1f1b", p, m))
        interleaved = simulate(order("interleaved-1f1b", p, m, v), chunk)
        assert one_f_one_b.makespan - 3 * m == 3 * (p - 1)
        assert interleaved.makespan - 3 * m == pytest.approx(3 * (p - 1) / v, abs=1e-9)
        assert interleaved.bubble_ratio == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)


# ---- memory -------------------------------------------------------------------------------


def test_interleaved_peak_activations() -> None:
    """Rank r holds min(vm, (v-1)g + w(r) + 1) stage activations (g: the first group; w(r) the warm-up
    beyond it: 1F1B's p-1-r for v = 1, Megatron-LM's 2(p-1-r) for v > 1, rank 0's p-1 on every rank when
    m <= p): p + (p-1)/v micro-batches on rank 0 when p divides m and v > 1, Megatron-LM's count."""
    for p in RANKS:
        for v in (1, 2, 3, 4):
            for m in range(1, 4 * p + 2):
                g = microbatch_groups(p, m)[0]
                peaks = simulate(order("interleaved-1f1b", p, m, v)).peak_activations
                deep = v > 1 and m <= p
                warm = [p - 1 - r if v == 1 else p - 1 if deep else 2 * (p - 1 - r) for r in range(p)]
                expected = [Fraction(min(v * m, (v - 1) * g + w + 1), v) for w in warm]
                assert [Fraction(x).limit_denominator(v) for x in peaks] == expected, (p, m, v)
                if m % p == 0:
                    megatron = 2 * (p - 1) + (v - 1) * p + 1 if v > 1 else p
                    assert peaks[0] * v == pytest.approx(min(v * m, megatron))


def test_bfs_transfer_closed_form() -> None:
    """The table's transfer column: a transfer time c <= F adds 2(vp-1)c for m <= p (one micro-batch's
    round trip through every stage), 2(p-1)c for m >= 2p (GPipe's: the loop's other hops hide behind work)."""
    for v in (1, 2, 3):
        for p in range(2, 9):
            for m in [*range(1, p + 1), *range(2 * p, 3 * p + 2)]:
                compute = sw.schedules.generate("looped-bfs", p, m, v)
                free = simulate(compute).makespan
                hops = 2 * (v * p - 1) if m <= p else 2 * (p - 1)
                for c in (0.125, 0.5, 1.0):
                    timed = simulate(compute, CostModel.uniform(p * v, comm_time=c)).makespan
                    assert timed == pytest.approx(free + hops * c), (p, m, v, c)


def test_bfs_holds_every_activation_at_the_turn() -> None:
    for p in RANKS:
        for v in (1, 2, 3):
            for m in microbatch_counts(p):
                assert simulate(order("looped-bfs", p, m, v)).peak_activations == pytest.approx([m] * p)


# ---- structure ----------------------------------------------------------------------------


def test_with_one_stage_per_rank_they_are_1f1b_and_gpipe() -> None:
    for p in RANKS:
        for m in microbatch_counts(p):
            assert sw.schedules.generate("interleaved-1f1b", p, m, 1).ranks == sw.schedules.generate("1f1b", p, m).ranks
            assert sw.schedules.generate("looped-bfs", p, m, 1).ranks == sw.schedules.generate("gpipe", p, m).ranks


def test_microbatch_groups() -> None:
    assert microbatch_groups(4, 3) == [3]
    assert microbatch_groups(4, 8) == [4, 4]
    assert microbatch_groups(4, 11) == [6, 5]
    assert microbatch_groups(3, 16) == [4, 3, 3, 3, 3]
    for p in range(1, 9):
        for m in range(p, 5 * p):
            groups = microbatch_groups(p, m)
            assert sum(groups) == m and len(groups) == m // p
            assert all(p <= a for a in groups) and groups == sorted(groups, reverse=True)


def test_interleaved_golden_text() -> None:
    assert order("interleaved-1f1b", 2, 4, 2).to_text() == (
        "rank 0: 0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3\n"
        "rank 1: 1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3"
    )
    assert sw.build_schedule("interleaved-1f1b", 2, 2, 2).to_text() == (
        "rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 2RECV_F0 2F0 2SEND_F0 2RECV_F1 2F1 2SEND_F1 "
        "2RECV_B0 2B0 2SEND_B0 2RECV_B1 2B1 2SEND_B1 2SYNC 0RECV_B0 0B0 0RECV_B1 0B1 0SYNC\n"
        "rank 1: 1RECV_F0 1F0 1SEND_F0 1RECV_F1 1F1 1SEND_F1 3RECV_F0 3F0 3RECV_F1 3F1 3B0 3SEND_B0 "
        "3B1 3SEND_B1 3SYNC 1RECV_B0 1B0 1SEND_B0 1RECV_B1 1B1 1SEND_B1 1SYNC"
    )


def test_bfs_golden_text() -> None:
    assert sw.schedules.generate("looped-bfs", 2, 3, 2).to_text() == (
        "rank 0: 0F0 0F1 0F2 2F0 2F1 2F2 2B0 2B1 2B2 0B0 0B1 0B2\n"
        "rank 1: 1F0 1F1 1F2 3F0 3F1 3F2 3B0 3B1 3B2 1B0 1B1 1B2"
    )


# ---- invariants ---------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(NAMES),
    p=st.integers(1, 8),
    v=st.integers(1, 4),
    data=st.data(),
)
def test_each_stage_and_microbatch_once_and_bubble_never_grows_with_m(
    name: str, p: int, v: int, data: st.DataObject
) -> None:
    m = data.draw(st.integers(1, 5 * p), label="m")
    schedule = order(name, p, m, v)
    counts = Counter((a.stage, a.kind, a.microbatch) for acts in schedule.ranks for a in acts)
    assert set(counts.values()) == {1}
    assert set(counts) == {(s, k, i) for s in range(p * v) for k in (Kind.F, Kind.B) for i in range(m)}
    assert all(a.stage % p == r for r, acts in enumerate(schedule.ranks) for a in acts)
    validate_schedule(schedule)
    now, more = simulate(schedule), simulate(order(name, p, m + 1, v))
    assert now.makespan == optimum(p, m, v)
    assert more.bubble_ratio <= now.bubble_ratio + 1e-12


def _plain_orders(name: str, p: int, m: int, v: int) -> tuple[tuple[Action, ...], ...]:
    """The orders the docstrings describe, action by action (the reference for the column generators)."""
    ranks = []
    for r in range(p):
        if name == "looped-bfs":
            acts = [Action(c * p + r, Kind.F, i) for c in range(v) for i in range(m)]
            acts += [Action(c * p + r, Kind.B, i) for c in range(v - 1, -1, -1) for i in range(m)]
        else:
            groups, first, fwd, bwd = microbatch_groups(p, m), 0, [], []
            for size in groups:
                fwd += [(c, i) for c in range(v) for i in range(first, first + size)]
                bwd += [(c, i) for c in range(v - 1, -1, -1) for i in range(first, first + size)]
                first += size
            deep = v > 1 and m <= p  # every rank as deep as rank 0
            extra = p - 1 - r if v == 1 else p - 1 if deep else 2 * (p - 1 - r)  # Megatron-LM's for v > 1
            warmup = min((v - 1) * groups[0] + extra, v * m)
            acts = [Action(c * p + r, Kind.F, i) for c, i in fwd[:warmup]]
            for (cf, i), (cb, j) in zip(fwd[warmup:], bwd, strict=False):
                acts += [Action(cf * p + r, Kind.F, i), Action(cb * p + r, Kind.B, j)]
            acts += [Action(c * p + r, Kind.B, i) for c, i in bwd[v * m - warmup :]]
        ranks.append(tuple(acts))
    return tuple(ranks)


@pytest.mark.parametrize("name", NAMES)
def test_column_orders_equal_the_plain_orders(name: str) -> None:
    """The generators compute their orders as arrays (ActionRows); spelled out action by action they agree."""
    for p in (1, 2, 3, 4, 5, 8):
        for m in range(1, 3 * p + 3):
            for v in (1, 2, 3):
                rows = sw.schedule_info(name).generator(p, m, v)
                assert isinstance(rows, ActionRows)
                assert tuple(rows) == _plain_orders(name, p, m, v), (name, p, m, v)
