"""The fast weight-version computations and version validator against the straightforward reference.

:mod:`stagewise.asynchronous.versions` builds tables on interned rows and comprehensions and
:mod:`stagewise.validate.versions_fast` decides validity on whole rows; the
reference (:mod:`stagewise.asynchronous.reference`, and the per-entry reporting
checks of :mod:`stagewise.validate.versions`) goes action by action. On
generated asynchronous schedules and on random edits of them (actions moved,
STEPs moved, table entries changed) both must give the same tables, the same
live-version counts and the same verdict.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from hypothesis import given, settings
from hypothesis import strategies as st

import stagewise as sw
from helpers.examples import examples
from stagewise.asynchronous import POLICIES, Version, VersionTable, live_versions, reference, step_counts, version_table
from stagewise.ir import Action, ActionRows, Schedule, columns
from stagewise.validate.versions import _bounds, _rules, _shape, _table_matches
from stagewise.validate.versions_fast import first_version_problem

VARIANTS = [
    ("pipedream", {}),
    ("pipedream", {"stashing": False}),
    ("pipedream", {"vertical_sync": True}),
    ("pipedream-2bw", {}),
    ("xpipe", {}),
]


@st.composite
def async_schedules(draw: st.DrawFn) -> Schedule:
    name, opts = draw(st.sampled_from(VARIANTS))
    p = draw(st.integers(1, 4))
    m = draw(st.integers(max(1, p - 1) if name == "pipedream-2bw" else 1, 3))
    return sw.schedules.async_schedule(name, p, draw(st.integers(1, 4)), m, **opts)


def _moved(schedule: Schedule, data: st.DataObject, edits: int) -> tuple[tuple[Action, ...], ...]:
    """The schedule's lists with ``edits`` actions moved within their rank (any kind, STEPs included)."""
    ranks = [list(acts) for acts in schedule.ranks]
    for _ in range(edits):
        r = data.draw(st.integers(0, len(ranks) - 1))
        acts = ranks[r]
        a = acts.pop(data.draw(st.integers(0, len(acts) - 1)))
        acts.insert(data.draw(st.integers(0, len(acts))), a)
    return tuple(map(tuple, ranks))


def _tables_equal(a: VersionTable, b: VersionTable) -> bool:
    return dataclasses.astuple(a) == dataclasses.astuple(b)


@settings(max_examples=examples(150), deadline=None)
@given(schedule=async_schedules(), data=st.data(), edits=st.integers(0, 3), policy=st.sampled_from(POLICIES))
def test_fast_tables_and_live_counts_equal_the_reference(
    schedule: Schedule, data: st.DataObject, edits: int, policy: str
) -> None:
    table = schedule.meta["versions"]
    ranks = _moved(schedule, data, edits)
    n, total = schedule.num_stages, schedule.num_microbatches
    args = (ranks, n, policy, table.minibatches, table.microbatches)
    assert step_counts(ranks, n, total) == reference.step_counts(ranks, n, total)
    fast, slow = version_table(*args), reference.version_table(*args)
    assert _tables_equal(fast, slow)
    assert live_versions(ranks, fast) == reference.live_versions(ranks, slow)


def _reference_verdict(schedule: Schedule, table: VersionTable) -> bool:
    """True when the per-entry checks (the reference) find no problem."""
    problems = _shape(schedule, table)
    return not (problems or _table_matches(schedule, table) or _rules(schedule, table) or _bounds(schedule, table))


@settings(max_examples=examples(200), deadline=None)
@given(schedule=async_schedules(), data=st.data(), edits=st.integers(0, 2), retable=st.integers(0, 3))
def test_fast_and_reference_version_verdicts_agree(
    schedule: Schedule, data: st.DataObject, edits: int, retable: int
) -> None:
    """Moved actions, a table made for another policy (relabelled or not), or one entry changed: same verdict."""
    table = schedule.meta["versions"]
    ranks = _moved(schedule, data, edits)
    if retable == 1:  # another policy's table, claimed as that policy (rules and bounds decide)
        other = data.draw(st.sampled_from(POLICIES))
        table = version_table(ranks, schedule.num_stages, other, table.minibatches, table.microbatches)
    elif retable == 2:  # another policy's table under the schedule's own policy's name
        other = data.draw(st.sampled_from(POLICIES))
        made = version_table(ranks, schedule.num_stages, other, table.minibatches, table.microbatches)
        table = dataclasses.replace(made, policy=table.policy)
    elif retable == 3:  # one entry moved to another version
        which = data.draw(st.sampled_from(["forward", "backward"]))
        rows = [list(r) for r in getattr(table, which)]
        s = data.draw(st.integers(0, len(rows) - 1))
        i = data.draw(st.integers(0, len(rows[s]) - 1))
        old = rows[s][i]
        rows[s][i] = data.draw(
            st.sampled_from([Version(old.base + 1, old.ahead), Version(old.base, old.ahead + 1), Version(0)])
        )
        table = dataclasses.replace(table, **{which: tuple(map(tuple, rows))})
    mutant = Schedule(schedule.name, schedule.num_microbatches, schedule.placement, ranks, {"versions": table})
    fast_ok = first_version_problem(mutant, table) is None
    assert fast_ok == _reference_verdict(mutant, table)
    if not fast_ok:
        try:
            sw.validate.validate_versions(mutant)
        except sw.ScheduleError as err:
            assert err.problems
        else:
            raise AssertionError("validate_versions accepted a schedule the fast path refused")


def _outcome(fn: Callable[..., object], *args: object) -> object:
    try:
        out = fn(*args)
    except Exception as err:  # noqa: BLE001 - the reference's own failure is part of what must match
        return type(err)
    return dataclasses.astuple(out) if isinstance(out, VersionTable) else out


def test_a_hand_written_action_out_of_range_goes_to_the_reference() -> None:
    """A stage or micro-batch outside the table, or an F without a micro-batch: the reference's answer (or error)."""
    schedule = sw.schedules.async_schedule("pipedream", 2, 2, 1)
    table = schedule.meta["versions"]
    for extra in (
        Action(0, sw.ir.Kind.F, 7),
        Action(5, sw.ir.Kind.B, 0),
        Action(0, sw.ir.Kind.F, None),
        Action(1, sw.ir.Kind.B),
    ):
        ranks = (schedule.ranks[0] + (extra,), schedule.ranks[1])
        assert _outcome(step_counts, ranks, 2, 2) == _outcome(reference.step_counts, ranks, 2, 2)
        assert _outcome(version_table, ranks, 2, "stash", 2, 1) == _outcome(
            reference.version_table, ranks, 2, "stash", 2, 1
        )
        assert _outcome(live_versions, ranks, table) == _outcome(reference.live_versions, ranks, table)


def _as_columns(ranks: tuple[tuple[Action, ...], ...], n: int, total: int) -> ActionRows | None:
    """The same lists as columns (what the generators and the lowering hand over), when they read as numbers."""
    cols = columns(Schedule("edited", total, tuple(range(n)), ranks))
    return None if cols is None else ActionRows(cols)


@settings(max_examples=examples(150), deadline=None)
@given(
    schedule=async_schedules(),
    data=st.data(),
    edits=st.integers(0, 3),
    policy=st.sampled_from(POLICIES),
    repeat=st.booleans(),
)
def test_column_tables_and_live_counts_equal_the_reference(
    schedule: Schedule, data: st.DataObject, edits: int, policy: str, repeat: bool
) -> None:
    """Step counts, tables (lifetimes included) and live counts computed on columns equal the reference's, also
    with an action repeated somewhere on its rank (two last uses with one text)."""
    table = schedule.meta["versions"]
    ranks = _moved(schedule, data, edits)
    if repeat:
        r = data.draw(st.integers(0, len(ranks) - 1))
        acts = list(ranks[r])
        acts.insert(data.draw(st.integers(0, len(acts))), data.draw(st.sampled_from(acts)))
        ranks = (*ranks[:r], tuple(acts), *ranks[r + 1 :])
    n, total = schedule.num_stages, schedule.num_microbatches
    rows = _as_columns(ranks, n, total)
    assert rows is not None
    assert step_counts(rows, n, total) == reference.step_counts(ranks, n, total)
    fast = version_table(rows, n, policy, table.minibatches, table.microbatches)
    slow = reference.version_table(ranks, n, policy, table.minibatches, table.microbatches)
    assert _tables_equal(fast, slow)
    assert live_versions(rows, fast) == reference.live_versions(ranks, slow)
    if not repeat:
        assert rows._rows.count(None) == len(rows)  # all of it without making an action


@settings(max_examples=examples(150), deadline=None)
@given(schedule=async_schedules(), data=st.data(), edits=st.integers(0, 2), steps=st.integers(0, 1))
def test_column_verdicts_agree_with_the_reference(
    schedule: Schedule, data: st.DataObject, edits: int, steps: int
) -> None:
    """The shape, table, rules and bounds checks on columns: the reference's verdict on moved actions and on a
    STEP dropped or a backward split."""
    table = schedule.meta["versions"]
    ranks = [list(acts) for acts in _moved(schedule, data, edits)]
    if steps:
        r = data.draw(st.integers(0, len(ranks) - 1))
        j = data.draw(st.integers(0, len(ranks[r]) - 1))
        a = ranks[r][j]
        if a.kind is sw.ir.Kind.STEP:
            del ranks[r][j]
        elif a.kind is sw.ir.Kind.B:
            ranks[r][j : j + 1] = [
                Action(a.stage, sw.ir.Kind.I, a.microbatch),
                Action(a.stage, sw.ir.Kind.W, a.microbatch),
            ]
    plain = Schedule(schedule.name, schedule.num_microbatches, schedule.placement, tuple(map(tuple, ranks)))
    rows = _as_columns(plain.ranks, schedule.num_stages, schedule.num_microbatches)
    assert rows is not None
    as_cols = Schedule(schedule.name, schedule.num_microbatches, schedule.placement, rows, {"versions": table})
    assert first_version_problem(as_cols, table) == first_version_problem(plain, table)
    assert (first_version_problem(as_cols, table) is None) == _reference_verdict(plain, table)
