"""The fast validator agrees with the straightforward reference, on valid and on broken schedules.

``validate_schedule`` decides on flat integer arrays (``stagewise._validate_fast``)
and asks the reference (``stagewise._validate_reference``) to name the problems;
these property tests keep the two verdicts equal on random small schedules,
including ones broken by random edits.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import stagewise as sw
from stagewise import Action, Kind, Schedule, ScheduleError
from stagewise._validate_fast import first_problem
from stagewise._validate_reference import reference_problems
from stagewise.validate import validate_reference


@st.composite
def base_schedules(draw: st.DrawFn) -> Schedule:
    """A registered synchronous schedule at a small size, compute-only, lowered, with steps, or forward-only
    (asynchronous ones add version rules, checked by tests/test_async_schedules.py)."""
    name = draw(st.sampled_from(sw.schedule_names(synchronous=True)))
    info = sw.schedule_info(name)
    p = draw(st.integers(1, 4))
    m = draw(st.integers(1, 5))
    v = draw(st.sampled_from(info.virtual_stages or (1, 2, 3)))
    form = draw(st.sampled_from(["compute", "lowered", "split", "steps", "forward", "forward-compute"]))
    schedule = sw.generate(name, p, m, v)
    if form == "compute":
        return schedule
    if form == "forward-compute":
        return sw.forward_only(schedule, validate=False)
    lowered = sw.lower(schedule, split=form == "split", optimizer_steps=form == "steps", validate=False)
    return sw.forward_only(lowered, validate=False) if form == "forward" else lowered


def _mutate(schedule: Schedule, data: st.DataObject) -> Schedule:
    ranks = [list(acts) for acts in schedule.ranks]
    r = data.draw(st.integers(0, len(ranks) - 1), label="rank")
    acts = ranks[r]
    how = data.draw(
        st.sampled_from(["swap", "move", "delete", "duplicate", "microbatch", "other rank", "step", "kind"]),
        label="mutation",
    )
    if not acts and how != "step":
        how = "step"
    if how == "step":
        stage = data.draw(st.sampled_from(schedule.stages_of(r)), label="stage")
        acts.insert(data.draw(st.integers(0, len(acts)), label="at"), Action(stage, Kind.STEP))
        return schedule.with_ranks(ranks)
    i = data.draw(st.integers(0, len(acts) - 1), label="i")
    j = data.draw(st.integers(0, len(acts) - 1), label="j")
    a = acts[i]
    if how == "swap":
        acts[i], acts[j] = acts[j], acts[i]
    elif how == "move":
        acts.insert(j, acts.pop(i))
    elif how == "delete":
        del acts[i]
    elif how == "duplicate":
        acts.insert(j, a)
    elif how == "microbatch" and a.microbatch is not None:
        mb = data.draw(st.integers(0, schedule.num_microbatches), label="mb")  # m itself is out of range
        acts[i] = Action(a.stage, a.kind, mb)
    elif how == "other rank" and schedule.num_ranks > 1:
        other = ranks[(r + 1) % len(ranks)]
        other.insert(min(j, len(other)), acts.pop(i))
    elif how == "kind" and a.microbatch is not None:
        kinds = [k for k in Kind if k not in (Kind.SYNC, Kind.STEP)]
        acts[i] = Action(a.stage, data.draw(st.sampled_from(kinds), label="kind"), a.microbatch)
    return schedule.with_ranks(ranks)


def _agree(schedule: Schedule) -> bool:
    """Assert fast and reference verdicts agree; return whether the schedule is valid."""
    fast = first_problem(schedule)
    reference = reference_problems(schedule)
    assert (fast is None) == (not reference), (
        f"fast path says {fast!r}, reference says {reference[:3]}\n{schedule.to_text()}"
    )
    return fast is None


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(base_schedules())
def test_fast_and_reference_accept_every_registered_form(schedule: Schedule) -> None:
    assert _agree(schedule)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(base_schedules(), st.data(), st.integers(1, 3))
def test_fast_and_reference_agree_on_broken_schedules(schedule: Schedule, data: st.DataObject, edits: int) -> None:
    for _ in range(edits):
        schedule = _mutate(schedule, data)
    if _agree(schedule):
        sw.validate_schedule(schedule)
        validate_reference(schedule)
        return
    with pytest.raises(ScheduleError) as fast_error:
        sw.validate_schedule(schedule)
    with pytest.raises(ScheduleError) as reference_error:
        validate_reference(schedule)
    # the fast path decides; the problems it reports are the reference's, first one included
    assert fast_error.value.problems == reference_error.value.problems


def test_a_validated_schedule_is_not_checked_twice_but_a_changed_mode_is() -> None:
    lowered = sw.build_schedule("1f1b", 3, 4)
    sw.validate_schedule(lowered)
    lowered.meta["forward_only"] = True  # the one mutable fact the verdict depends on
    with pytest.raises(ScheduleError, match="forward-only"):
        sw.validate_schedule(lowered)


def _receives_just_before_use(schedule: Schedule) -> Schedule:
    """The naive lowering the communication pass avoids: each receive moved right before its consumer.

    On looped placements (interleaved, breadth-first) blocked senders can then
    close a ring, so this gives real deadlocks (and valid schedules) to compare on.
    """
    n = schedule.num_stages
    ranks = []
    for acts in schedule.ranks:
        recvs = [a for a in acts if a.kind in (Kind.RECV_F, Kind.RECV_B)]
        by_consumer = {(a.stage, "F" if a.kind is Kind.RECV_F else "B", a.microbatch): a for a in recvs}
        out = []
        for a in acts:
            if a.kind in (Kind.RECV_F, Kind.RECV_B):
                continue
            direction = "F" if a.kind is Kind.F else "B" if a.kind in (Kind.B, Kind.I) else None
            recv = by_consumer.get((a.stage, direction, a.microbatch)) if direction else None
            if recv is not None and 0 <= a.stage < n:
                out.append(recv)
            out.append(a)
        ranks.append(out)
    return schedule.with_ranks(ranks)


@pytest.mark.parametrize("name", sw.schedule_names(synchronous=True))
def test_fast_and_reference_agree_on_naively_placed_receives(name: str) -> None:
    """Both find the same deadlocks (and accept the same survivors) when receives sit right before use."""
    info = sw.schedule_info(name)
    verdicts = []
    for p in (2, 3, 4):
        for m in (1, 2, 3, 5, 8):
            for v in info.virtual_stages or (2, 3):
                naive = _receives_just_before_use(sw.build_schedule(name, p, m, v))
                verdicts.append(_agree(naive))
                verdicts.append(_agree(sw.forward_only(naive, validate=False)))
    if name in ("interleaved-1f1b", "looped-bfs"):
        assert not all(verdicts), "expected some deadlocks on the loop (see schedules/interleaved.py)"
