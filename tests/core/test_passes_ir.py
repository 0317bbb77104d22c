"""Everything executed is in the IR: optimizer steps placed by a pass, eval schedules made by a pass, both validated."""

from __future__ import annotations

import pytest

import stagewise as sw
from stagewise import Action, Schedule, ScheduleError
from stagewise.ir import Kind
from stagewise.validate import validate_reference

FORWARD_KINDS = (Kind.F, Kind.SEND_F, Kind.RECV_F)


#: the passes apply to synchronous schedules (asynchronous ones place a SYNC and a STEP per mini-batch themselves)
SYNCHRONOUS = sw.schedule_names(synchronous=True)


def _grid() -> list[tuple[str, int, int, int]]:
    """Every registered schedule x ranks x micro-batches x virtual stages, with m < p, m = 1 and p = 1."""
    cases = []
    for name in SYNCHRONOUS:
        vs = sw.schedule_info(name).virtual_stages or (1, 2, 3)
        cases += [(name, p, m, v) for p in (1, 2, 3, 4) for m in (1, 2, 3, 5, 8) for v in vs]
    return cases


GRID = _grid()


def _index(schedule: Schedule, rank: int, action: Action) -> int:
    return schedule.ranks[rank].index(action)


@pytest.mark.parametrize(("name", "p", "m", "v"), GRID)
def test_optimizer_steps_follow_each_stage_sync(name: str, p: int, m: int, v: int) -> None:
    plain = sw.build_schedule(name, p, m, v)
    stepped = sw.build_schedule(name, p, m, v, optimizer_steps=True)
    validate_reference(stepped)  # the straightforward checks agree with the fast ones lower() ran
    for s in range(stepped.num_stages):
        rank = stepped.rank_of(s)
        sync = _index(stepped, rank, Action(s, Kind.SYNC))
        assert stepped.ranks[rank][sync + 1 :].count(Action(s, Kind.STEP)) == 1
        step = _index(stepped, rank, Action(s, Kind.STEP))
        # right after its SYNC, or after other stages' SYNC/STEP inserted at the same place
        between = stepped.ranks[rank][sync + 1 : step]
        assert all(a.kind in (Kind.SYNC, Kind.STEP) for a in between), between
    # nothing else moved: removing the steps gives back the schedule without them
    assert [[a for a in acts if a.kind is not Kind.STEP] for acts in stepped.ranks] == [
        list(acts) for acts in plain.ranks
    ]


@pytest.mark.parametrize(("name", "p", "m", "v"), GRID)
def test_forward_only_keeps_the_forwards_in_training_order_and_validates(name: str, p: int, m: int, v: int) -> None:
    train = sw.build_schedule(name, p, m, v, optimizer_steps=True)
    evaluation = sw.passes.forward_only(train)
    assert evaluation.meta["forward_only"] is True
    assert [list(acts) for acts in evaluation.ranks] == [
        [a for a in acts if a.kind in FORWARD_KINDS] for acts in train.ranks
    ]
    validate_reference(evaluation)
    forwards = sorted((a.stage, a.microbatch) for acts in evaluation.ranks for a in acts if a.kind is Kind.F)
    assert forwards == [(s, i) for s in range(evaluation.num_stages) for i in range(m)]
    # the compute-only forward pass times to the closed form of a pipeline fill: no rank waits on backward
    timed = sw.simulate(sw.passes.forward_only(sw.schedules.generate(name, p, m, v)))
    assert timed.makespan >= evaluation.num_stages + m - 1 - 1e-9  # every micro-batch crosses every stage


def test_forward_only_is_idempotent_and_the_train_mode_is_unchanged() -> None:
    train = sw.build_schedule("interleaved-1f1b", 3, 7, 2)
    evaluation = sw.passes.forward_only(train)
    assert sw.passes.forward_only(evaluation) is evaluation
    assert "forward_only" not in train.meta
    sw.validate_schedule(train)


def _stepped(name: str = "zb-h1", p: int = 3, m: int = 4) -> list[list[Action]]:
    return [list(acts) for acts in sw.build_schedule(name, p, m, optimizer_steps=True).ranks]


def _check(ranks: list[list[Action]], like: Schedule | None = None, **meta: object) -> None:
    base = like or sw.build_schedule("zb-h1", 3, 4)
    schedule = base.with_ranks(ranks)
    schedule.meta.update(meta)
    sw.validate_schedule(schedule)


def test_a_step_before_the_last_weight_gradient_is_refused() -> None:
    ranks = _stepped()
    acts = ranks[0]
    step = acts.pop(acts.index(Action(0, Kind.STEP)))
    acts.insert(acts.index(Action(0, Kind.W, 3)), step)
    with pytest.raises(ScheduleError, match=r"rank 0 action #\d+ 0W3 .*: stage 0's W comes after its optimizer step"):
        _check(ranks)


def test_a_step_before_its_sync_is_refused() -> None:
    ranks = _stepped()
    acts = ranks[1]
    step = acts.pop(acts.index(Action(1, Kind.STEP)))
    acts.insert(acts.index(Action(1, Kind.SYNC)), step)
    with pytest.raises(
        ScheduleError, match=r"rank 1 action #\d+ 1SYNC .*: stage 1's SYNC comes after its optimizer step"
    ):
        _check(ranks)


def test_steps_for_some_stages_only_or_twice_are_refused() -> None:
    ranks = _stepped()
    ranks[2].remove(Action(2, Kind.STEP))
    with pytest.raises(ScheduleError, match=r"rank 2: stage 2 has 0 optimizer steps \(2STEP\), expected 1"):
        _check(ranks)
    ranks = _stepped()
    ranks[0].append(Action(0, Kind.STEP))
    with pytest.raises(ScheduleError, match=r"rank 0: stage 0 has 2 optimizer steps"):
        _check(ranks)


def test_forward_only_schedules_refuse_backward_sync_and_step() -> None:
    evaluation = sw.passes.forward_only(sw.build_schedule("1f1b", 2, 2))
    for extra, message in (
        (Action(0, Kind.B, 0), r"has 1x 0B0, 0x 0I0, 0x 0W0 in a forward-only schedule, expected no backward work"),
        (Action(0, Kind.SYNC), r"a forward-only schedule has no SYNC"),
        (Action(0, Kind.STEP), r"a forward-only schedule has no STEP"),
    ):
        ranks = [list(acts) for acts in evaluation.ranks]
        ranks[0].append(extra)
        with pytest.raises(ScheduleError, match=message):
            _check(ranks, like=evaluation)
    # and a training schedule marked forward-only is refused for its backward work
    with pytest.raises(ScheduleError, match="expected no backward work"):
        train = sw.build_schedule("1f1b", 2, 2)
        _check([list(acts) for acts in train.ranks], like=train, forward_only=True)


def test_add_optimizer_steps_keeps_existing_steps_and_works_without_sync() -> None:
    stepped = sw.passes.lower(sw.schedules.generate("gpipe", 2, 3), optimizer_steps=True)
    assert sw.passes.add_optimizer_steps(stepped).ranks == stepped.ranks
    no_sync = sw.passes.lower(sw.schedules.generate("gpipe", 2, 3), grad_sync=False, optimizer_steps=True)
    assert no_sync.ranks[0][-1] == Action(0, Kind.STEP)  # after the last B (rank 0's last action)
    rank1 = no_sync.ranks[1]
    between = rank1[rank1.index(Action(1, Kind.B, 2)) + 1 : rank1.index(Action(1, Kind.STEP))]
    assert list(between) == [Action(1, Kind.SEND_B, 2)]  # the last B's gradient goes out first, in the same batch
