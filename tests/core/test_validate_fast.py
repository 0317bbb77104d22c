"""The fast validator agrees with the straightforward reference, on valid and on broken schedules.

``validate_schedule`` decides on flat integer arrays (``stagewise.validate.fast``)
and asks the reference (``stagewise.validate.reference``) to name the problems;
these property tests keep the two verdicts equal on random small schedules,
including ones broken by random edits.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import stagewise as sw
from helpers.certificates import batches, certified, fitting_certificate, longest_paths, partner_edges
from helpers.examples import examples
from stagewise import Action, Schedule, ScheduleError
from stagewise.ir import Kind
from stagewise.passes.reference import add_communication_reference
from stagewise.validate import validate_reference
from stagewise.validate.arrays import proves_valid
from stagewise.validate.fast import first_problem
from stagewise.validate.reference import reference_problems


@st.composite
def base_schedules(draw: st.DrawFn) -> Schedule:
    """A registered synchronous schedule at a small size, compute-only, lowered, with steps, or forward-only
    (asynchronous ones add version rules, checked by tests/core/test_async_schedules.py)."""
    name = draw(st.sampled_from(sw.schedule_names(synchronous=True)))
    info = sw.schedule_info(name)
    p = draw(st.integers(1, 4))
    m = draw(st.integers(1, 5))
    v = draw(st.sampled_from(info.virtual_stages or (1, 2, 3)))
    form = draw(st.sampled_from(["compute", "lowered", "split", "steps", "forward", "forward-compute"]))
    schedule = sw.schedules.generate(name, p, m, v)
    if form == "compute":
        return schedule
    if form == "forward-compute":
        return sw.passes.forward_only(schedule, validate=False)
    lowered = sw.passes.lower(schedule, split=form == "split", optimizer_steps=form == "steps", validate=False)
    return sw.passes.forward_only(lowered, validate=False) if form == "forward" else lowered


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


@settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(base_schedules())
def test_fast_and_reference_accept_every_registered_form(schedule: Schedule) -> None:
    assert _agree(schedule)


@settings(max_examples=examples(600), deadline=None, suppress_health_check=[HealthCheck.too_slow])
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
                verdicts.append(_agree(sw.passes.forward_only(naive, validate=False)))
    if name in ("interleaved-1f1b", "looped-bfs"):
        assert not all(verdicts), "expected some deadlocks on the loop (see schedules/interleaved.py)"


# ---- the array path: lowering on whole arrays, validation by progress certificate ---------------------------


@settings(max_examples=examples(200), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sampled_from(sw.schedule_names()),
    st.integers(1, 5),
    st.integers(1, 8),
    st.integers(1, 3),
    st.booleans(),
    st.booleans(),
)
def test_array_lowering_equals_the_reference_pass(name: str, p: int, m: int, v: int, split: bool, steps: bool) -> None:
    """Same actions in the same order on every rank, and the same certificate (the uniform start times)."""
    info = sw.schedule_info(name)
    v = info.virtual_stages[v % len(info.virtual_stages)] if info.virtual_stages else v
    try:
        schedule = sw.schedules.generate(name, p, m, v)
    except ValueError:  # a size this schedule does not take
        return
    if split:
        schedule = sw.passes.split_backward(schedule)
    schedule = sw.passes.add_grad_sync(schedule)
    if steps:
        schedule = sw.passes.add_optimizer_steps(schedule)
    reference = add_communication_reference(schedule)
    assert reference is not None
    expected, certificate = reference
    lowered = sw.passes.add_communication(schedule)
    assert lowered.ranks == expected.ranks
    assert lowered.__dict__["_progress_certificate"] == certificate


@st.composite
def certified_schedules(draw: st.DrawFn) -> tuple[Schedule, list[list[int]]]:
    """A registered synchronous schedule on 2-4 ranks, lowered by the reference pass, with its certificate."""
    name = draw(st.sampled_from(sw.schedule_names(synchronous=True)))
    info = sw.schedule_info(name)
    schedule = sw.schedules.generate(
        name, draw(st.integers(2, 4)), draw(st.integers(1, 5)), draw(st.sampled_from(info.virtual_stages or (1, 2)))
    )
    if draw(st.booleans()):
        schedule = sw.passes.split_backward(schedule)
    schedule = sw.passes.add_grad_sync(schedule)
    if draw(st.booleans()):
        schedule = sw.passes.add_optimizer_steps(schedule)
    return certified(schedule)


def _nudge(schedule: Schedule, data: st.DataObject) -> Schedule:
    """Swap two neighbouring actions of a rank: edits that keep progress but break an order, most often."""
    ranks = [list(acts) for acts in schedule.ranks]
    acts = ranks[data.draw(st.integers(0, len(ranks) - 1), label="rank")]
    if len(acts) > 1:
        i = data.draw(st.integers(0, len(acts) - 2), label="i")
        acts[i], acts[i + 1] = acts[i + 1], acts[i]
    return schedule.with_ranks(ranks)


@settings(max_examples=examples(500), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(certified_schedules(), st.data(), st.integers(0, 3))
def test_certified_path_agrees_with_the_reference(
    lowered_and_certificate: tuple[Schedule, list[list[int]]], data: st.DataObject, edits: int
) -> None:
    """Lowered schedules, then edited. Given a certificate that fits (the lowering's before any edit, then
    one computed from the edited schedule's waits), the array path accepts exactly what the reference
    accepts; a stale certificate never makes it accept what the reference rejects."""
    lowered, certificate = lowered_and_certificate
    assert proves_valid(lowered, certificate)
    for _ in range(edits):
        lowered = _nudge(lowered, data) if data.draw(st.booleans(), label="nudge") else _mutate(lowered, data)
    valid = not reference_problems(lowered)
    if proves_valid(lowered, certificate):
        assert valid
    fitting = fitting_certificate(lowered)
    if fitting is not None:
        assert proves_valid(lowered, fitting) == valid
    object.__setattr__(lowered, "_progress_certificate", fitting or certificate)
    _agree(lowered)  # through first_problem, which tries the array path first


def test_certificate_checks_catch_deadlocks() -> None:
    """Receives placed just before use deadlock on stages placed several to a rank (zb-v's orders: the
    interleaved ones no longer do since their warm-up is Megatron-LM's). No certificate passes there: not the
    lowering's, not per-rank batch numbers (increasing, but ignoring partners), and not numbers that respect
    every partner but decrease along a rank (the mutant that skips the increase check accepts those)."""
    decreasing_found = 0
    names = ("interleaved-1f1b", "looped-bfs", "zb-v")
    sizes = [(name, p, m) for name in names for p in (2, 3, 4) for m in (2, 3, 5, 8)]
    for name, p, m in sizes:
        lowered, certificate = certified(sw.passes.add_grad_sync(sw.schedules.generate(name, p, m, 2)))
        naive = _receives_just_before_use(lowered)
        if not reference_problems(naive):
            continue
        counts, _, _ = batches(naive)
        assert not proves_valid(naive, [list(range(c)) for c in counts])
        if [len(c) for c in certificate] == counts:
            assert not proves_valid(naive, certificate)
        nodes, edges = partner_edges(naive)
        partner_only = longest_paths(nodes, edges)
        if partner_only is None:
            continue
        c = [[partner_only[(r, b)] for b in range(n)] for r, n in enumerate(counts)]
        assert not proves_valid(naive, c)
        decreasing_found += 1
    assert decreasing_found, "expected a deadlock whose partner constraints alone can be satisfied"


@settings(max_examples=examples(200), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(base_schedules(), st.data())
def test_random_certificates_prove_nothing_false(schedule: Schedule, data: st.DataObject) -> None:
    """Any numbers at all: accepted only on schedules the reference accepts (the check is sound for every c)."""
    if schedule.is_complete or schedule.num_ranks < 2 or schedule.meta.get("forward_only"):
        return
    lowered, certificate = certified(sw.passes.add_grad_sync(schedule))
    candidates = [lowered, _receives_just_before_use(lowered), _mutate(lowered, data)]
    target = data.draw(st.sampled_from(candidates), label="schedule")
    counts, _, _ = batches(target)
    c = [data.draw(st.lists(st.integers(-3, 12), min_size=k, max_size=k), label="c") for k in counts]
    if proves_valid(target, c):
        assert not reference_problems(target)


def test_a_schedule_made_from_a_lowered_one_carries_no_certificate() -> None:
    lowered = sw.build_schedule("1f1b", 3, 4)
    assert "_progress_certificate" in lowered.__dict__
    assert "_progress_certificate" not in lowered.with_ranks(lowered.ranks).__dict__


def _sender(schedule: Schedule, a: Action) -> int:
    """The rank a receive takes its value from (-1 for any other action)."""
    if a.kind is Kind.RECV_F:
        return schedule.placement[a.stage - 1]
    if a.kind is Kind.RECV_B:
        return schedule.placement[a.stage + 1]
    return -1


def test_a_receive_moved_before_an_earlier_one_from_its_sender_fails_the_channel_order() -> None:
    """A receive moved to just before the previous receive from the same sender: every count and local order
    still holds, and often progress too (by a certificate that pairs by message), but the k-th receive on the
    channel is no longer the k-th send: only the channel order check says no, as the reference does."""
    found = 0
    for name in sw.schedule_names(synchronous=True):
        for p, m in ((2, 4), (3, 6)):
            lowered, _ = certified(sw.passes.add_grad_sync(sw.schedules.generate(name, p, m)))
            for rank, acts in enumerate(lowered.ranks):
                senders = [_sender(lowered, a) for a in acts]
                for j in range(len(acts)):
                    earlier = [i for i in range(j) if senders[i] == senders[j] >= 0]
                    if not earlier:
                        continue
                    ranks = [list(a) for a in lowered.ranks]
                    ranks[rank].insert(earlier[-1], ranks[rank].pop(j))
                    moved = lowered.with_ranks(ranks)
                    assert reference_problems(moved)
                    fitting = fitting_certificate(moved)
                    if fitting is not None:
                        assert not proves_valid(moved, fitting)
                        found += 1
    assert found
