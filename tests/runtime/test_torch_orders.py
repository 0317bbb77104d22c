"""torch.distributed.pipelining's schedule classes read into stagewise, and stagewise's CSV read by torch's own
loader, in one process (stand-in stages: no process group). Training on both runtimes:
tests/distributed/test_torch_interop.py.

Supported: torch 2.13 (the version stagewise pins); on a torch without ``_PipelineScheduleRuntime`` (or
without its 2.13 action kinds) the module skips, saying why.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import stagewise as sw
from stagewise.cli.main import main
from stagewise.interop import from_torch, to_torch_csv
from stagewise.interop.torch_words import read_action, write_actions
from stagewise.runtime.interop import torch_order, torch_pipelining_missing, torch_runtime

pytestmark = pytest.mark.skipif(torch_pipelining_missing() is not None, reason=str(torch_pipelining_missing()))

#: torch's classes: (name, stages per rank to read them with)
CLASSES = [
    ("GPipe", (1,)),
    ("1F1B", (1,)),
    ("Interleaved1F1B", (2, 3)),
    ("LoopedBFS", (2, 3)),
    ("InterleavedZeroBubble", (2, 3)),
    ("ZBVZeroBubble", (2,)),
    ("DualPipeV", (2,)),
]
GRID = [(name, p, m, v) for name, vs in CLASSES for p in (2, 4) for m in (p, 2 * p) for v in vs]
#: what torch itself refuses to build (its constructor's reason)
TORCH_REFUSES = {"DualPipeV": "requires at least as many microbatches as stages"}


def _texts(schedule: sw.Schedule, compute: bool = True) -> list[list[str]]:
    ranks = schedule.compute_only().ranks if compute else schedule.ranks
    return [[str(a) for a in acts if a.kind is not sw.ir.Kind.SYNC] for acts in ranks]


@pytest.mark.parametrize("read", ["pipeline_order", "step"])
@pytest.mark.parametrize(("name", "p", "m", "v"), GRID, ids=[f"{n}-p{p}-m{m}-v{v}" for n, p, m, v in GRID])
def test_every_torch_schedule_reads_validates_simulates_and_draws(name: str, p: int, m: int, v: int, read: str) -> None:
    if name in TORCH_REFUSES and m < 2 * p:
        with pytest.raises(ValueError, match=TORCH_REFUSES[name]):
            torch_order(name, p, m, v, read=read)
        return
    order = torch_order(name, p, m, v, read=read)
    if name == "1F1B" and read == "pipeline_order":  # torch's table numbers the last rank's forwards one too high
        with pytest.raises(sw.ScheduleError, match=rf"rank {p - 1} action #\d+ {p - 1}F{m} .* outside 0\.\.{m - 1}"):
            from_torch(order)
        return
    schedule = from_torch(order)  # validated
    assert (schedule.num_ranks, schedule.num_microbatches, schedule.virtual_stages) == (p, m, v)
    assert schedule.is_complete == (read == "step" and name not in ("GPipe", "1F1B"))
    result = sw.simulate(schedule)
    assert result.makespan > 0 and len(sw.render_ascii(result.timeline).splitlines()) >= p
    if read == "step" and schedule.is_complete:  # torch's lowering: its FSDP actions kept beside the schedule
        assert {t[2][-7:] for t in schedule.meta["torch_annotations"]} == {"UNSHARD", "RESHARD"}


@pytest.mark.parametrize(("name", "twin"), [("1F1B", "1f1b"), ("GPipe", "gpipe")])
@pytest.mark.parametrize(("p", "m"), [(1, 3), (2, 2), (2, 5), (4, 4), (4, 9)])  # torch: m >= p
def test_the_single_stage_classes_step_runs_stagewises_schedule_of_the_same_name(
    name: str, twin: str, p: int, m: int
) -> None:
    """torch's own loop, recorded on stand-in stages: 1F1B's step() runs the order its table gets wrong."""
    ran = from_torch(torch_order(name, p, m, read="step"))
    assert _texts(ran) == _texts(sw.schedules.generate(twin, p, m))


def test_the_step_reading_of_a_runtime_class_is_torchs_lowered_table() -> None:
    """For a _PipelineScheduleRuntime subclass, step() interprets pipeline_order_with_comms: the table's compute
    in the same order, with torch's communication, which stagewise's validator (blocking, batched) accepts."""
    table = from_torch(torch_order("ZBVZeroBubble", 4, 8))
    ran = from_torch(torch_order("ZBVZeroBubble", 4, 8, read="step"))
    assert _texts(ran) == _texts(table) and ran.is_complete and not table.is_complete


def _stand_ins(p: int, n: int, rank: int, stages: tuple[int, ...]) -> list[Any]:
    from torch import nn

    return [
        SimpleNamespace(
            num_stages=n, group_size=p, group_rank=rank, stage_index=s, stage_index_to_group_rank={}, submod=nn.Module()
        )
        for s in stages
    ]


def _torch_loads(schedule: sw.Schedule, fmt: str, tmp_path: Path) -> Any:
    """torch's loader on the CSV, as torchtitan runs it (every rank lowers the whole schedule)."""
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    path = tmp_path / "schedule.csv"
    path.write_text(to_torch_csv(schedule, format=fmt))  # type: ignore[arg-type]
    loaded = _PipelineScheduleRuntime(
        _stand_ins(schedule.num_ranks, schedule.num_stages, 0, schedule.stages_of(0)), schedule.num_microbatches
    )
    loaded._load_csv(str(path), format=fmt)
    return loaded


SCHEDULES = [
    (name, p, m) for name in sw.schedule_names(synchronous=True) for p in (1, 2, 4) for m in sorted({1, p, 2 * p + 1})
]


@pytest.mark.parametrize(("name", "p", "m"), SCHEDULES, ids=[f"{n}-p{p}-m{m}" for n, p, m in SCHEDULES])
def test_torchs_loader_reads_every_registered_schedule_as_stagewise_runs_it(
    name: str, p: int, m: int, tmp_path: Path
) -> None:
    built = sw.build_schedule(name, p, m, sw.schedule_info(name).default_virtual_stages)
    as_run = [[a for a in acts if a.kind is not sw.ir.Kind.STEP] for acts in built.ranks]
    comms = _torch_loads(built, "compute_comms", tmp_path)
    assert [[str(a) for a in comms.pipeline_order_with_comms[r]] for r in range(p)] == [
        list(write_actions(tuple(acts), comms=True)) for acts in as_run
    ]
    assert comms.stage_index_to_group_rank == dict(enumerate(built.placement))
    lowered = _torch_loads(built, "compute_only", tmp_path)  # torch adds its own communication: same compute order
    ran = from_torch({r: lowered.pipeline_order_with_comms[r] for r in range(p)}, num_microbatches=m)
    assert _texts(ran) == _texts(built)


def test_torch_loads_a_last_stage_out_of_order_which_is_why_stagewise_refuses_it(tmp_path: Path) -> None:
    """The loader accepts it (the failure comes in step(), tests/distributed); to_torch_csv refuses it."""
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    rows = {0: "0F1 0F0 0B1 0B0".split(), 1: "1F1 1F0 1B1 1B0".split()}
    schedule = from_torch(rows)  # valid for stagewise
    with pytest.raises(ValueError, match="runs its forwards in the order"):
        to_torch_csv(schedule)
    path = tmp_path / "mb1-first.csv"
    path.write_text("\n".join(",".join(write_actions(acts, comms=False)) for acts in schedule.ranks) + "\n")
    loaded = _PipelineScheduleRuntime(_stand_ins(2, 2, 0, (0,)), 2)
    loaded._load_csv(str(path))
    assert [str(a) for a in loaded.pipeline_order[1]] == rows[1]


def test_torch_order_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match="unknown torch schedule 'Nope'"):
        torch_order("Nope", 2, 4)
    with pytest.raises(ValueError, match="holds one stage per rank: v must be 1"):
        torch_order("ScheduleGPipe", 2, 4, 2)
    with pytest.raises(ValueError, match="read must be one of"):
        torch_order("GPipe", 2, 4, read="table")
    with pytest.raises(TypeError, match="schedule class or its name"):
        torch_order(int, 2, 4)  # type: ignore[arg-type]
    for base in ("PipelineScheduleMulti", "PipelineScheduleSingle", "_PipelineScheduleRuntime"):
        with pytest.raises((ValueError), match=f"{base.lstrip('_')} is a base of torch's schedule classes"):
            torch_order(base if base[0] != "_" else _runtime_class(), 2, 4)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="ZBV requires exactly 2 stages per rank"):
        torch_order("ZBVZeroBubble", 2, 4, 3)
    from torch.distributed.pipelining import ScheduleLoopedBFS

    assert torch_order(ScheduleLoopedBFS, 2, 4).name == "ScheduleLoopedBFS"
    assert read_action(None) == read_action("")  # a bubble, either way


def _runtime_class() -> type:
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    return _PipelineScheduleRuntime


def test_from_torch_reads_a_runtime_loaded_from_compute_comms_and_hints_at_a_built_1f1b() -> None:
    schedule = sw.build_schedule("zb-v", 2, 4)
    loaded = torch_runtime(schedule, _stand_ins(2, 4, 0, (0, 3)), loss_fn=None, format="compute_comms")
    assert not any(loaded.pipeline_order.values())  # torch fills only the list it runs
    as_run = [[a for a in acts if a.kind is not sw.ir.Kind.STEP] for acts in schedule.ranks]
    assert _texts(from_torch(loaded), compute=False) == _texts(schedule.with_ranks(as_run), compute=False)
    from torch.distributed.pipelining import Schedule1F1B

    built = Schedule1F1B(_stand_ins(2, 2, 0, (0,))[0], 4)  # torchtitan's default class, as a program builds it
    with pytest.raises(sw.ScheduleError, match=r"from_torch\(stagewise.runtime.torch_order\(Schedule1F1B, p=2, m=4"):
        from_torch(built)


def test_simulate_refuses_torchs_base_classes_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    for base in ("PipelineScheduleMulti", "PipelineScheduleSingle"):
        assert main(["simulate", "--from-torch", base, "-p", "2", "-m", "4"]) == 2
        assert f"{base} is a base of torch's schedule classes, with no order of its own" in capsys.readouterr().err


def test_torch_runtime_refuses_stages_that_do_not_match_the_schedule() -> None:
    schedule = sw.build_schedule("zb-v", 2, 4)
    with pytest.raises(ValueError, match=r"places stages \[0, 3\] on rank 0, got stages \[0, 2\]"):
        torch_runtime(schedule, _stand_ins(2, 4, 0, (0, 2)), loss_fn=None)
    with pytest.raises(ValueError, match="has 4 stages; the stages were built with num_stages=.2."):
        torch_runtime(schedule, _stand_ins(2, 2, 0, (0,)), loss_fn=None)
    with pytest.raises(ValueError, match="runs on 2 ranks, the stages' group has 4"):
        torch_runtime(schedule, _stand_ins(4, 4, 0, (0, 3)), loss_fn=None)
    loaded = torch_runtime(schedule, _stand_ins(2, 4, 1, (1, 2)), loss_fn=None, format="compute_comms")
    assert loaded.stage_index_to_group_rank == {0: 0, 1: 1, 2: 1, 3: 0}


def test_simulate_from_torch_draws_torchs_schedule(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "dualpipev.png"
    assert main(["simulate", "--from-torch", "DualPipeV", "-p", "2", "-m", "4", "--ascii", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("ScheduleDualPipeV: 2 ranks, 2 stages per rank, 4 micro-batches") and png.stat().st_size
    assert main(["simulate", "--from-torch", "1F1B", "-p", "2", "-m", "4"]) == 1
    assert "micro-batch 4 is outside 0..3" in capsys.readouterr().err
    assert main(["simulate", "--from-torch", "1F1B", "-p", "2", "-m", "4", "--torch-read", "step", "--json"]) == 0
    assert '"schedule": "Schedule1F1B"' in capsys.readouterr().out
    assert main(["simulate", "--from-torch", "Nope", "-p", "2", "-m", "4"]) == 2
    assert "unknown torch schedule 'Nope'" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["Interleaved1F1B", "ZBVZeroBubble", "DualPipeV"])
@pytest.mark.parametrize("read", ["pipeline_order", "step"])
def test_a_torch_order_saves_the_file_torchs_own_dump_writes(name: str, read: str, tmp_path: Path) -> None:
    """TorchOrder.save_csv writes what torch's _dump_csv writes (compute_only: the table; compute_comms: what
    step() runs), so golden files of torch's orders can be made by stagewise and read back without torch."""
    from torch.distributed.pipelining.schedules import get_schedule_class

    built = get_schedule_class(name)(_stand_ins(2, 4, 0, (0, 2)), 4)
    built._dump_csv(str(tmp_path / "torch.csv"), format="compute_only" if read == "pipeline_order" else "compute_comms")
    order = torch_order(name, 2, 4, read=read)
    order.save_csv(tmp_path / "stagewise.csv")
    assert (tmp_path / "stagewise.csv").read_text().splitlines() == (tmp_path / "torch.csv").read_text().splitlines()
    assert _texts(from_torch(tmp_path / "torch.csv", num_microbatches=4)) == _texts(from_torch(order))
