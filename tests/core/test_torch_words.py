"""torch.distributed.pipelining's words and orders, read and written without torch (stagewise.interop).

The torch side (building a class's order, torch's own loader and runtime) is tested in
tests/runtime/test_torch_orders.py and tests/distributed/test_torch_interop.py.
"""

from __future__ import annotations

import enum
from pathlib import Path
from typing import NamedTuple

import pytest

import stagewise as sw
from stagewise.cli.main import main
from stagewise.interop import TorchOrder, from_torch, to_torch_csv, torch_placement, torch_problems
from stagewise.ir import Action, Kind, Schedule
from stagewise.passes import forward_only, lower

#: torch 2.13's Schedule1F1B.pipeline_order at p=2, m=4, as it prints: the last rank's forwards are numbered
#: one too high (1F1 before 1B0, and a 1F4), while its step() runs 1F0 1B0 1F1 ... (tests/runtime reads it)
TORCH_1F1B_TABLE = {
    0: "0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3 0REDUCE_GRAD".split(),
    1: "1F1 1B0 1F2 1B1 1F3 1B2 1F4 1B3 1REDUCE_GRAD".split(),
}


class _Kind(str, enum.Enum):  # torch's _ComputationType, as far as a reader sees it
    F = "F"
    B = "B"
    OVERLAP_F_B = "OVERLAP_F_B"


class _TorchAction(NamedTuple):  # torch's _Action, as far as a reader sees it
    stage_index: int
    computation_type: _Kind
    microbatch_index: int | None = None
    sub_actions: tuple[_TorchAction, ...] | None = None


def _texts(schedule: Schedule) -> list[list[str]]:
    return [[str(a) for a in acts] for acts in schedule.ranks]


def test_every_torch_word_reads() -> None:
    """F/B/I/W and communication as themselves, REDUCE_GRAD as SYNC, OVERLAP_F_B as its parts in order,
    UNSHARD/RESHARD as annotations at their position, bubbles as nothing."""
    order = {
        0: ["0UNSHARD", "0F0", "0SEND_F0", "", None, "0RECV_B0", "0I0", "0W0", "0REDUCE_GRAD", "0RESHARD"],
        1: ["1RECV_F0", "(1F0;1B0)OVERLAP_F_B", "1SEND_B0", "1REDUCE_GRAD"],
    }
    schedule = from_torch(order)
    assert _texts(schedule) == [
        ["0F0", "0SEND_F0", "0RECV_B0", "0I0", "0W0", "0SYNC"],
        ["1RECV_F0", "1F0", "1B0", "1SEND_B0", "1SYNC"],
    ]
    assert schedule.meta["torch_annotations"] == ((0, 0, "0UNSHARD"), (0, 6, "0RESHARD"))
    assert schedule.placement == (0, 1) and schedule.num_microbatches == 1 and schedule.is_complete


def test_torch_action_objects_read_as_their_text() -> None:
    """torch's _Action values are read by their fields (duck typing: the core imports no torch)."""
    objects = {
        0: [_TorchAction(0, _Kind.F, 0), None, _TorchAction(0, _Kind.B, 0)],
        1: [_TorchAction(-1, _Kind.OVERLAP_F_B, None, (_TorchAction(1, _Kind.F, 0), _TorchAction(1, _Kind.B, 0)))],
    }
    assert _texts(from_torch(objects)) == _texts(from_torch({0: ["0F0", "0B0"], 1: ["(1F0;1B0)OVERLAP_F_B"]}))


@pytest.mark.parametrize(
    ("cell", "words"),
    [
        ("0X0", ["rank 1, position 2", "cannot read torch action '0X0'"]),
        ("(1F0;1B0)FUSED", ["only OVERLAP_F_B groups"]),
        ("1REDUCE_GRAD3", ["whole stage"]),
        ("1F", ["needs a micro-batch"]),
        ("1UNSHARD1", ["rank 1, position 2", "UNSHARD applies to a whole stage, not micro-batch 1"]),
        ("1RESHARD0", ["RESHARD applies to a whole stage"]),
    ],
)
def test_a_word_it_cannot_read_is_named_with_its_place(cell: str, words: list[str]) -> None:
    with pytest.raises(ValueError) as err:
        from_torch({0: ["0F0", "0B0"], 1: ["1F0", "1B0", cell]})
    for w in words:
        assert w in str(err.value)


def test_torch_1f1b_table_is_refused_with_the_validators_explanation() -> None:
    with pytest.raises(sw.ScheduleError, match=r"rank 1 action #6 1F4 .*micro-batch 4 is outside 0\.\.3"):
        from_torch(TORCH_1F1B_TABLE, num_microbatches=4)
    order = TorchOrder("Schedule1F1B", 4, tuple(tuple(r) for r in TORCH_1F1B_TABLE.values()))
    with pytest.raises(sw.ScheduleError, match=r"torch_order\(Schedule1F1B, \.\.\., read='step'\)") as err:
        from_torch(order)
    assert "1F4" in str(err.value)  # the validator's words come first, the hint after them
    mended = {0: TORCH_1F1B_TABLE[0], 1: "1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3 1REDUCE_GRAD".split()}
    assert _texts(from_torch(mended).compute_only()) == _texts(sw.schedules.generate("1f1b", 2, 4))


def test_an_order_that_hangs_is_refused_by_the_validator() -> None:
    with pytest.raises(sw.ScheduleError, match=r"deadlock: rank 0 action #1 0B0 .* waits for"):
        from_torch({0: "0F0 0B0 0F1 0B1".split(), 1: "1F1 1B1 1F0 1B0".split()})  # each waits for the other


@pytest.mark.parametrize("name", sw.schedule_names(synchronous=True))
@pytest.mark.parametrize(("p", "m"), [(1, 3), (2, 5), (4, 8)])
def test_every_registered_schedule_round_trips_through_both_formats(name: str, p: int, m: int) -> None:
    v = sw.schedule_info(name).default_virtual_stages
    built = sw.build_schedule(name, p, m, v, optimizer_steps=True)
    compute_only = to_torch_csv(built)
    assert {c[-1:] for row in compute_only.split() for c in row.split(",")} <= set("0123456789")
    assert all(w in "FBIW" for row in compute_only.split() for c in row.split(",") for w in c.strip("0123456789"))
    assert _texts(from_torch(compute_only, num_microbatches=m)) == _texts(built.compute_only())
    # compute_comms: every action as run, SYNC as REDUCE_GRAD, no STEP (torch's optimizer runs after step())
    comms = to_torch_csv(built, format="compute_comms")
    assert "STEP" not in comms and "SYNC" not in comms
    without_steps = [[a for a in acts if a.kind is not Kind.STEP] for acts in built.ranks]
    assert _texts(from_torch(comms, num_microbatches=m)) == _texts(built.with_ranks(without_steps))


def test_compute_comms_lowers_a_compute_only_schedule_and_adds_reduce_grad() -> None:
    order = sw.schedules.generate("1f1b", 2, 3)
    assert to_torch_csv(order, format="compute_comms") == to_torch_csv(lower(order), format="compute_comms")
    assert to_torch_csv(order, format="compute_comms").count("REDUCE_GRAD") == 2
    no_sync = from_torch(to_torch_csv(lower(order, grad_sync=False), format="compute_comms"))
    for acts in no_sync.ranks:  # a REDUCE_GRAD read back as SYNC, right after the stage's last backward
        compute = [a for a in acts if a.kind in (Kind.B, Kind.SYNC)]
        assert compute[-1].kind is Kind.SYNC and compute[-2] == Action(compute[-1].stage, Kind.B, 2)


def _last_stage_backwards() -> Schedule:
    """Valid in stagewise: rank 0 sends micro-batch 1 first, the last stage runs 1F1 before 1F0."""
    return Schedule(
        "mb1-first",
        2,
        (0, 1),
        (
            tuple(map(sw.ir.parse_action, "0F1 0F0 0B1 0B0".split())),
            tuple(map(sw.ir.parse_action, "1F1 1F0 1B1 1B0".split())),
        ),
    )


def test_what_torchs_runtime_cannot_run_is_refused_with_the_reason() -> None:
    out_of_order = _last_stage_backwards()
    sw.validate_schedule(out_of_order)  # stagewise trains it (tests/distributed/test_torch_interop.py)
    (reason,) = torch_problems(out_of_order)
    assert "last stage (1, on rank 1)" in reason and "[1, 0]" in reason and "position" in reason
    for fmt in ("compute_only", "compute_comms"):
        with pytest.raises(ValueError, match="runs its forwards in the order"):
            to_torch_csv(out_of_order, format=fmt)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="asynchronous"):
        to_torch_csv(sw.build_schedule("pipedream", 2, 4))
    with pytest.raises(ValueError, match="forward-only"):
        to_torch_csv(forward_only(sw.build_schedule("1f1b", 2, 4)))
    with pytest.raises(ValueError, match="format must be one of"):
        to_torch_csv(sw.build_schedule("1f1b", 2, 4), format="compute")  # type: ignore[arg-type]


def test_an_invalid_stagewise_schedule_is_not_written() -> None:
    broken = Schedule("broken", 1, (0, 1), ((Action(0, Kind.F, 0), Action(0, Kind.B, 0)), (Action(1, Kind.F, 0),)))
    with pytest.raises(sw.ScheduleError, match="1B0"):
        to_torch_csv(broken)


def test_a_torch_order_as_data_and_as_a_file(tmp_path: Path) -> None:
    rows = (("0F0", "", "0B0", "0REDUCE_GRAD"), ("", "1F0", "1B0", "1REDUCE_GRAD"))
    order = TorchOrder("ScheduleGPipe", 1, rows, "step")
    assert order.to_csv() == "0F0,,0B0,0REDUCE_GRAD\n,1F0,1B0,1REDUCE_GRAD\n"
    order.save_csv(tmp_path / "gpipe.csv")
    from_file = from_torch(tmp_path / "gpipe.csv")
    assert from_file.name == "gpipe" and _texts(from_file) == _texts(from_torch(order))
    assert from_torch(order).name == "ScheduleGPipe"


def test_what_from_torch_does_not_take_is_named() -> None:
    with pytest.raises(TypeError, match=r"a torch schedule class\? build its order with"):
        from_torch(int)
    with pytest.raises(TypeError, match=r"pass pathlib.Path\('order.csv'\)"):
        from_torch("order.csv")
    with pytest.raises(ValueError, match="keyed by ranks 0..p-1"):
        from_torch({1: ["1F0"], 2: ["2F0"]})


def test_torch_placement_says_how_torchtitan_must_place_the_stages() -> None:
    assert torch_placement(sw.build_schedule("interleaved-1f1b", 4, 8, 3)) == "loop"
    assert torch_placement(sw.build_schedule("1f1b", 4, 8)) == "one"  # a single-stage class, not a looped one
    assert torch_placement(sw.build_schedule("zb-v", 4, 8)) == "v"
    odd = Schedule(
        "odd", 1, (1, 0), ((Action(1, Kind.F, 0), Action(1, Kind.B, 0)), (Action(0, Kind.F, 0), Action(0, Kind.B, 0)))
    )
    assert torch_placement(odd) is None


def test_a_built_schedule1f1b_is_refused_with_the_hint_to_read_its_step() -> None:
    """torchtitan's default class, built by a program: its table is refused, and the hint says how to read it."""

    class Schedule1F1B:  # torch's class as from_torch sees a built one: its table, its counts
        pipeline_order = TORCH_1F1B_TABLE
        pp_group_size, _n_microbatches = 2, 4

    with pytest.raises(sw.ScheduleError) as err:
        from_torch(Schedule1F1B())
    assert "from_torch(stagewise.runtime.torch_order(Schedule1F1B, p=2, m=4, read='step'))" in str(err.value)
    assert "micro-batch 4 is outside 0..3" in str(err.value)


def test_a_runtime_loaded_from_compute_comms_reads_the_order_it_runs() -> None:
    """torch's _load_csv(format="compute_comms") leaves pipeline_order empty and fills pipeline_order_with_comms."""

    class _PipelineScheduleRuntime:
        pipeline_order: dict[int, list[str]] = {}
        pipeline_order_with_comms = {0: "0F0 0SEND_F0 0RECV_B0 0B0".split(), 1: "1RECV_F0 1F0 1B0 1SEND_B0".split()}
        _n_microbatches = 1

    read = from_torch(_PipelineScheduleRuntime())
    assert _texts(read) == [list(r) for r in _PipelineScheduleRuntime.pipeline_order_with_comms.values()]
    with pytest.raises(ValueError, match="holds no actions"):
        from_torch({0: [], 1: [None]})


@pytest.mark.parametrize(
    ("rows", "cell"),
    [
        (
            {0: "0F0 0F1 0B0 0B2".split(), 1: "1F0 1F1 1B0 1B1".split()},
            "rank 0, position 3: 0B2: stage 0 has no forward",
        ),
        (
            {0: "0F0 0F1 0B0 0B1".split(), 1: "1F0 1F2 1B0 1B1".split()},
            "rank 1, position 1: 1F2: stage 1 has no backward",
        ),
    ],
)
def test_a_micro_batch_typo_is_named_at_its_cell(rows: dict[int, list[str]], cell: str) -> None:
    with pytest.raises(sw.ScheduleError) as err:
        from_torch(rows)
    assert err.value.problems[0].startswith(cell), err.value.problems


def test_simulate_notes_torchs_fsdp_actions(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "fsdp.csv"
    path.write_text("0UNSHARD,0F0,0B0,0RESHARD\n1UNSHARD,1F0,1B0,1RESHARD\n")
    assert main(["simulate", "--from-torch", str(path), "-p", "2", "-m", "1"]) == 0
    assert "torch's FSDP actions (UNSHARD, RESHARD): 4 set aside" in capsys.readouterr().out


def test_python_and_the_cli_makespans_differ_by_the_stages_per_rank(capsys: pytest.CaptureFixture[str]) -> None:
    """The CLI's times are per rank (each of v stages takes 1/v), sw.simulate's default costs per stage: for zb-v
    at p 4, m 8 the CLI prints 25.5 where Python gives 51, and says why."""
    assert main(["simulate", "-s", "zb-v", "-p", "4", "-m", "8"]) == 0
    out = capsys.readouterr().out
    cli = float(out.split("makespan")[1].split()[0])
    assert cli * 2 == sw.simulate(sw.build_schedule("zb-v", 4, 8)).makespan == 51
    assert "times are per rank: each of its 2 stages takes 1/2 of them" in out
