"""The IR: action text form, schedule text/CSV round trips, placements."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import stagewise as sw
from stagewise import Action, Schedule
from stagewise.ir import Kind, parse_action

GOLDEN = Path(__file__).parents[1] / "golden"


def test_text_form_examples() -> None:
    assert str(Action(2, Kind.F, 0)) == "2F0"
    assert str(Action(1, Kind.SEND_B, 3)) == "1SEND_B3"
    assert str(Action(0, Kind.SYNC)) == "0SYNC"
    assert parse_action("1SEND_B3") == Action(1, Kind.SEND_B, 3)
    assert parse_action(" 12RECV_F105 ") == Action(12, Kind.RECV_F, 105)
    assert parse_action("3STEP") == Action(3, Kind.STEP, None)


@given(
    stage=st.integers(0, 10_000),
    kind=st.sampled_from(list(Kind)),
    mb=st.integers(0, 10_000),
)
def test_text_form_round_trips(stage: int, kind: Kind, mb: int) -> None:
    action = Action(stage, kind, None if kind in (Kind.SYNC, Kind.STEP) else mb)
    assert parse_action(str(action)) == action


@pytest.mark.parametrize(
    ("text", "fragment"),
    [("F0", "cannot parse"), ("2X0", "cannot parse"), ("2F", "needs a micro-batch"), ("2SYNC1", "whole stage")],
)
def test_bad_text_is_rejected_with_reason(text: str, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        parse_action(text)


def test_kinds_say_what_they_are() -> None:
    assert [k.value for k in Kind if k.is_backward] == ["B", "I", "W"]
    assert [k.value for k in Kind if k.is_compute] == ["F", "B", "I", "W"]


def test_a_schedule_says_whether_it_is_asynchronous() -> None:
    """The one answer (stagewise.schedules.is_asynchronous asks it of a Schedule): a version table carried."""
    assert sw.build_schedule("pipedream", 2, 2).is_asynchronous
    assert not sw.build_schedule("1f1b", 2, 2).is_asynchronous
    assert sw.schedules.is_asynchronous("xpipe") and not sw.schedules.is_asynchronous("zb-v")


def test_placements() -> None:
    assert sw.ir.loop_placement(3, 2) == (0, 1, 2, 0, 1, 2)
    assert sw.ir.v_placement(3, 2) == (0, 1, 2, 2, 1, 0)
    assert sw.ir.v_placement(2, 3) == (0, 1, 1, 0, 0, 1)


def test_csv_round_trip_keeps_every_action_and_the_placement() -> None:
    schedule = sw.build_schedule("1f1b", 3, 4)
    again = Schedule.from_csv(schedule.to_csv(), name="1f1b")
    assert again == schedule
    assert again.placement == (0, 1, 2)
    assert again.num_microbatches == 4


def test_golden_csv_files_load_validate_and_match_the_generators(tmp_path: Path) -> None:
    for path in sorted(GOLDEN.glob("*.csv")):
        name, p, m = path.stem.rsplit("-p", 1)[0], *map(int, path.stem.rsplit("-p", 1)[1].split("-m"))
        loaded = Schedule.load_csv(path)
        sw.validate_schedule(loaded)
        assert loaded.ranks == sw.build_schedule(name, p, m).ranks, path.name
        out = tmp_path / path.name
        loaded.save_csv(out)
        assert out.read_text() == path.read_text()


def test_hand_written_csv_may_leave_cells_empty() -> None:
    text = "0F0,0SEND_F0,,0RECV_B0,0B0\n1RECV_F0,1F0,1B0,1SEND_B0,\n"
    schedule = Schedule.from_csv(text, name="hand")
    sw.validate_schedule(schedule)
    assert schedule.num_ranks == 2 and schedule.num_microbatches == 1


def test_csv_errors_name_the_cell() -> None:
    with pytest.raises(ValueError, match="row 1 .*column 2"):
        Schedule.from_csv("0F0,0B0\n1F0,1B0,oops\n")
    with pytest.raises(ValueError, match="stage 0 has compute actions on rank 0 and on rank 1"):
        Schedule.from_csv("0F0,0B0\n0F1,0B1\n")


def test_split_backward_turns_each_b_into_i_then_w() -> None:
    split = sw.passes.split_backward(sw.schedules.generate("gpipe", 2, 2))
    assert split.to_text() == ("rank 0: 0F0 0F1 0I0 0W0 0I1 0W1\nrank 1: 1F0 1F1 1I0 1W0 1I1 1W1")
    sw.validate_schedule(sw.passes.lower(split))


def test_grad_sync_follows_each_stages_last_weight_gradient() -> None:
    schedule = sw.passes.add_grad_sync(sw.schedules.generate("1f1b", 2, 3))
    for rank, acts in enumerate(schedule.ranks):
        assert acts[-1] == Action(rank, Kind.SYNC)
        assert sum(a.kind is Kind.SYNC for a in acts) == 1


def test_docstring_examples_of_the_package() -> None:
    import doctest

    assert doctest.testmod(sw).failed == 0
