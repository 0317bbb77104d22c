"""The array simulator against the plain one, and schedules that are their columns (the lowering's output)."""

from __future__ import annotations

import pickle

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import stagewise as sw
from helpers.examples import examples
from oracles.simulate_reference import simulate_reference
from stagewise.ir import Action, ActionRows, Columns, Kind, Schedule, columns
from stagewise.simulation import CostModel, simulate
from stagewise.validate.fast import _check_ranges

_TIMES = st.floats(0.0, 4.0, allow_nan=False).map(lambda x: round(x, 3))


@st.composite
def schedules(draw: st.DrawFn) -> Schedule:
    """A registered schedule (synchronous or not) at a small size: compute-only, lowered, split, with steps,
    or with two neighbouring actions of a rank swapped (which may leave it unable to finish)."""
    name = draw(st.sampled_from(sw.schedule_names()))
    info = sw.schedule_info(name)
    p, m = draw(st.integers(1, 4)), draw(st.integers(1, 5))
    v = draw(st.sampled_from(info.virtual_stages or (1, 2, 3)))
    try:
        schedule = sw.schedules.generate(name, p, m, v)
    except ValueError:  # a size this schedule does not take
        schedule = sw.schedules.generate("1f1b", p, m, 1)
    form = draw(st.sampled_from(["compute", "lowered", "split", "steps", "swapped"]))
    if form != "compute" and schedule.num_ranks > 1:
        schedule = sw.passes.lower(
            schedule, split=form == "split" and info.synchronous, optimizer_steps=form == "steps", validate=False
        )
    if form == "swapped":
        ranks = [list(acts) for acts in schedule.ranks]
        acts = ranks[draw(st.integers(0, len(ranks) - 1))]
        if len(acts) > 1:
            i = draw(st.integers(0, len(acts) - 2))
            acts[i], acts[i + 1] = acts[i + 1], acts[i]
        schedule = schedule.with_ranks(ranks)
    return schedule


@st.composite
def cost_models(draw: st.DrawFn, n: int) -> CostModel:
    per_stage = st.lists(_TIMES, min_size=n, max_size=n).map(tuple)
    act = draw(st.lists(st.floats(0, 1e6).map(round), min_size=n, max_size=n).map(tuple))
    return CostModel(
        num_stages=n,
        forward=draw(per_stage),
        backward_input=draw(per_stage),
        backward_weight=draw(per_stage),
        activation_bytes=act,
        weight_activation_bytes=draw(st.lists(st.floats(0, 2e6).map(round), min_size=n, max_size=n).map(tuple)),
        parameter_bytes=(1.0,) * n,
        output_bytes=draw(per_stage),
        latency=draw(_TIMES),
        bandwidth=draw(st.sampled_from([float("inf"), 0.5, 3.0])),
        sync_time=draw(per_stage),
        step_time=draw(per_stage),
        backward_full=draw(st.one_of(st.just(()), per_stage)),  # B as measured, or I + W
    )


@settings(max_examples=examples(400), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schedules(), st.data())
def test_the_array_simulator_equals_the_plain_one(schedule: Schedule, data: st.DataObject) -> None:
    """Same start and end of every action, makespan, bubble and peaks, to the bit (same additions, same
    order); a schedule one cannot finish fails in both."""
    costs = data.draw(cost_models(schedule.num_stages), label="costs")
    try:
        expected = simulate_reference(schedule, costs)
    except ValueError:
        with pytest.raises(ValueError, match="cannot finish"):
            simulate(schedule, costs)
        return
    got = simulate(schedule, costs)
    assert got.starts == expected.starts
    assert got.ends == expected.ends
    assert got.makespan == expected.makespan
    assert got.bubble_ratio == expected.bubble_ratio
    assert got.peak_activations == expected.peak_activations
    assert got.peak_activation_bytes == expected.peak_activation_bytes
    assert [len(acts) for acts in got.actions] == [len(times) for times in expected.starts]


def test_an_unreadable_action_is_named() -> None:
    schedule = Schedule("odd", 1, (0,), ((Action(0, Kind.F, 0), Action(0, "B", 0)),))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"rank 0 runs \(0, 'B', 0\), which is not an action"):
        simulate(schedule)


def test_a_lowered_schedule_is_its_columns_and_makes_a_rank_only_when_asked() -> None:
    lowered = sw.build_schedule("zb-v", 3, 4, 2)
    rows = lowered.ranks
    assert isinstance(rows, ActionRows)
    assert rows._rows == [None, None, None]
    one = rows[1]
    assert rows._rows[0] is None and rows._rows[1] is one and rows[1] is one and rows[-2] is one
    plain = lowered.with_ranks(list(lowered.ranks))  # tuples of the same actions
    assert lowered.with_ranks(rows).ranks is rows  # a pass that keeps the rows keeps the columns
    assert not isinstance(plain.ranks, ActionRows)
    # the rows read back into exactly the columns they were made from
    mine, read = columns(lowered), columns(plain)
    assert mine is rows.columns and read is not None and mine is not read
    for field in ("kind", "stage", "microbatch", "base"):
        assert getattr(mine, field).tolist() == getattr(read, field).tolist()
    # and behave as the tuple of tuples they stand for
    assert rows == plain.ranks and plain.ranks == rows and hash(rows) == hash(plain.ranks)
    assert lowered == plain and hash(lowered) == hash(plain)
    assert rows[1:] == plain.ranks[1:] and list(rows) == list(plain.ranks)
    assert pickle.loads(pickle.dumps(lowered)).ranks == plain.ranks
    assert isinstance(pickle.loads(pickle.dumps(rows)), tuple)
    assert lowered.is_complete and plain.is_complete
    assert lowered.uses_split_backward == plain.uses_split_backward
    with pytest.raises(IndexError):
        rows[3]
    assert rows != plain.ranks[:2] and rows != plain.ranks[:2] + ((),)


def test_a_schedule_whose_actions_are_not_numbers_is_lowered_by_the_plain_pass() -> None:
    """Out-of-range micro-batches cannot be columns' indices: the plain pass lowers it, the validator names it."""
    good = sw.schedules.generate("gpipe", 2, 2)
    ranks = [list(acts) for acts in good.ranks]
    ranks[0][0] = Action(0, Kind.F, 7)
    with pytest.raises(sw.ScheduleError, match="micro-batch"):
        sw.passes.lower(good.with_ranks(ranks))


def test_a_value_made_twice_is_lowered_by_the_plain_pass_and_named() -> None:
    """Two actions making one value (4I2 twice on rank 0, 0I2 gone): the column pass's timing cannot tell which
    one a receive waits for (it indexed past the rank's actions: found by the property test below); the plain
    pass places it and the validator names both faults."""
    good = sw.passes.split_backward(sw.schedules.generate("interleaved-1f1b", 4, 4, 3))
    cols = columns(good)
    assert cols is not None
    k = [str(a) for a in good.ranks[0]].index("0I2")
    stage = cols.stage.copy()
    stage[int(cols.base[0]) + k] = 4
    rows = ActionRows(Columns(kind=cols.kind.copy(), stage=stage, microbatch=cols.microbatch.copy(), base=cols.base))
    for bad in (Schedule(good.name, 4, good.placement, rows), good.with_ranks([list(a) for a in rows])):
        with pytest.raises(sw.ScheduleError, match=r"stage 0 micro-batch 2 has 0x 0B2, 0x 0I2(.|\n)*2x 4I2"):
            sw.passes.lower(bad)


@st.composite
def column_schedules(draw: st.DrawFn) -> Schedule:
    """A compute-only registered schedule as columns (ActionRows), sometimes with a stage or a micro-batch
    moved out of place or range: what a column generator could hand the passes."""
    name = draw(st.sampled_from(sw.schedule_names(synchronous=True)))
    info = sw.schedule_info(name)
    p, m = draw(st.integers(1, 4)), draw(st.integers(1, 5))
    v = draw(st.sampled_from(info.virtual_stages or (1, 2, 3)))
    try:
        schedule = sw.schedules.generate(name, p, m, v)
    except ValueError:
        schedule = sw.schedules.generate("1f1b", p, m, 1)
    if draw(st.booleans()):
        schedule = sw.passes.split_backward(schedule)
    cols = columns(schedule)
    assert cols is not None
    stage, mb = cols.stage.copy(), cols.microbatch.copy()
    if draw(st.booleans()):
        field = draw(st.sampled_from([stage, mb]))
        field[draw(st.integers(0, field.size - 1))] = draw(st.integers(-1, schedule.num_stages + m))
    rows = ActionRows(Columns(kind=cols.kind.copy(), stage=stage, microbatch=mb, base=cols.base.copy()))
    return Schedule(schedule.name, m, schedule.placement, rows)


@given(column_schedules())
@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_column_passes_equal_the_object_passes(schedule: Schedule) -> None:
    """Grad sync and the range check on columns give what the object code gives on the same actions."""
    assert isinstance(schedule.ranks, ActionRows)
    plain = schedule.with_ranks(list(schedule.ranks))
    assert not isinstance(plain.ranks, ActionRows)
    assert _check_ranges(schedule) == _check_ranges(plain)
    synced, expected = sw.passes.add_grad_sync(schedule), sw.passes.add_grad_sync(plain)
    if _check_ranges(plain) is None:  # in place: the columns pass ran (no rank's row made)
        assert isinstance(synced.ranks, ActionRows) and synced.ranks._rows.count(None) == len(synced.ranks)
    assert synced.ranks == expected.ranks
    if _check_ranges(plain) is None:  # the whole lowering: the same schedule, or the same error
        assert _lowered(schedule) == _lowered(plain)


def _lowered(schedule: Schedule) -> Schedule | str:
    try:
        return sw.passes.lower(schedule)
    except sw.ScheduleError as err:
        return str(err)
