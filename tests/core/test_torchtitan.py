"""The torchtitan settings of a schedule file and the check of a file against a job's settings, without torch
(stagewise.interop.torchtitan). torch's own loader runs the recipe in tests/runtime/test_torchtitan_recipe.py."""

from __future__ import annotations

from pathlib import Path

import pytest

import stagewise as sw
from stagewise.cli.main import main
from stagewise.interop import from_torch, to_torch_csv, torchtitan_problems, torchtitan_settings
from stagewise.ir import Action, Kind, Schedule


@pytest.mark.parametrize(
    ("name", "v", "cls", "placement"),
    [
        ("1f1b", 1, "1F1B", "one stage per rank"),
        ("zb-h1", 1, "1F1B", "one stage per rank"),
        ("gpipe", 1, "1F1B", "one stage per rank"),
        ("interleaved-1f1b", 2, "Interleaved1F1B", "2 stages per rank, looped"),
        ("interleaved-1f1b", 3, "Interleaved1F1B", "3 stages per rank, looped"),
        ("zb-v", 2, "ZBVZeroBubble", "2 stages per rank, in a V"),
        ("dualpipe-v", 2, "ZBVZeroBubble", "2 stages per rank, in a V"),
    ],
)
def test_the_class_follows_the_placement(name: str, v: int, cls: str, placement: str) -> None:
    settings = torchtitan_settings(sw.build_schedule(name, 4, 8, v))
    assert (settings.pipeline_parallel_schedule, settings.placement) == (cls, placement)
    assert (settings.pipeline_parallel_degree, settings.stages_per_rank, settings.num_pp_microbatches) == (4, v, 8)
    flags = settings.flags("f.csv")
    assert f"--parallelism.pipeline_parallel_schedule {cls} " in flags and flags.endswith("num_pp_microbatches 8")
    assert ("pipeline_parallel_layers_per_stage" in (settings.stages_note or "")) == (v > 2)


def test_what_torchtitan_cannot_place_or_torch_cannot_run_is_refused() -> None:
    first, second = (Action(1, Kind.F, 0), Action(1, Kind.B, 0)), (Action(0, Kind.F, 0), Action(0, Kind.B, 0))
    odd = Schedule("odd", 1, (1, 0), (first, second))
    with pytest.raises(ValueError, match=r"torchtitan places stages one per rank, looped or in a V.*\[1, 0\]"):
        torchtitan_settings(odd)
    with pytest.raises(ValueError, match="asynchronous"):
        torchtitan_settings(sw.build_schedule("pipedream", 2, 4))


def test_the_checker_names_each_wrong_setting() -> None:
    v_file = from_torch(to_torch_csv(sw.build_schedule("zb-v", 2, 4)))
    assert torchtitan_problems(v_file, "ZBVZeroBubble", 4, pipeline_parallel_degree=2) == []
    assert torchtitan_problems(v_file, "schedulezbvzerobubble", 4) == []  # torch's spelling, any case
    problems = torchtitan_problems(v_file, "Interleaved1F1B", 8, pipeline_parallel_degree=4)
    assert [p.split(":")[0] for p in problems] == [
        "pipeline_parallel_degree 4",
        "rank 0",
        "num_pp_microbatches 8",
    ]
    assert "(the file fits ZBVZeroBubble, 2 stages per rank, in a V)" in problems[1]
    assert "1F1B builds 1 stage per rank, 2 on 2 ranks; the file has 4" in torchtitan_problems(v_file, "1F1B", 4)[0]
    assert "is a single-stage class" in torchtitan_problems(v_file, "1F1B", 4, stages_per_rank=2)[0]
    assert "exactly 2 per rank, not 3" in torchtitan_problems(v_file, "DualPipeV", 4, stages_per_rank=3)[0]
    assert "not a torch class torchtitan names" in torchtitan_problems(v_file, "ZeroBubbleV", 4)[0]
    comms = from_torch(to_torch_csv(sw.build_schedule("1f1b", 2, 4), format="compute_comms"))
    assert torchtitan_problems(comms, "1F1B", 4) == [
        "the file is compute_comms (rank 0 runs 0SEND_F0): torchtitan loads compute_only files; write it with "
        "to_torch_csv(schedule) or --torch-format compute_only"
    ]


def test_synthesize_says_torchtitan_loads_compute_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "c.csv"
    assert main(["synthesize", "-p", "2", "-m", "4", "--torch-csv", str(path), "--torch-format", "compute_comms"]) == 0
    assert "torchtitan: loads compute_only files only" in capsys.readouterr().out
    assert main(["simulate", "--from-torch", str(path), "-p", "2", "-m", "4", "--torchtitan", "1F1B"]) == 1
    assert "the file is compute_comms" in capsys.readouterr().err
    assert main(["simulate", "--from-torch", "GPipe", "-p", "2", "-m", "4", "--torchtitan", "1F1B"]) == 2
    assert "--torchtitan checks a file" in capsys.readouterr().err
