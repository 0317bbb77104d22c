"""``stagewise synthesize`` and the ``--torch-csv`` flag: what is written is the schedule that was synthesized
(or simulated), in the form torch's loader reads. ``--from-torch`` needs torch: tests/runtime/test_torch_orders.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import stagewise as sw
from stagewise.cli.main import main
from stagewise.simulation import CostModel


def _texts(schedule: sw.Schedule) -> list[list[str]]:
    return [[str(a) for a in acts] for acts in schedule.ranks]


def test_synthesize_writes_the_schedule_it_reports(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "auto.csv"
    torch_csv = tmp_path / "auto-torch.csv"
    argv = ["synthesize", "-p", "2", "-m", "5", "--i-time", "1.5", "--w-time", "0.5", "--comm-time", "0.25"]
    assert main([*argv, "--csv", str(out), "--torch-csv", str(torch_csv)]) == 0
    printed = capsys.readouterr().out
    expected = sw.synthesize(
        CostModel.uniform(2, forward=1.0, backward_input=1.5, backward_weight=0.5, comm_time=0.25), 2, 5
    )
    assert f"makespan   {expected.meta['synthesis']['makespan']:g}" in printed  # type: ignore[index]
    assert f"wrote torch compute_only CSV: {torch_csv}" in printed
    # one stage per rank, said as such: torchtitan needs a single-stage class there (a looped one fails to load)
    assert "torchtitan: one stage per rank: pipeline_parallel_schedule 1F1B, num_pp_microbatches 5" in printed
    assert f"--parallelism.pipeline_parallel_schedule_csv {torch_csv} --parallelism.num_pp_microbatches 5" in printed
    assert _texts(sw.Schedule.load_csv(out)) == _texts(expected)
    assert _texts(sw.from_torch(torch_csv, num_microbatches=5)) == _texts(expected.compute_only())


def test_synthesize_compute_comms_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch_csv = tmp_path / "v.csv"
    argv = ["synthesize", "-p", "2", "-m", "4", "-v", "2", "--json", "--torch-csv", str(torch_csv)]
    assert main([*argv, "--torch-format", "compute_comms"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["virtual_stages"] == 2 and report["makespan"] >= report["lower_bound"] > 0
    expected = sw.synthesize(
        CostModel.uniform(4, forward=0.5, backward_input=0.5, backward_weight=0.5), 2, 4, virtual_stages=2
    )
    assert "REDUCE_GRAD" in torch_csv.read_text()
    assert _texts(sw.from_torch(torch_csv)) == _texts(expected)  # comms and SYNC as synthesized and lowered


def test_simulate_writes_a_registered_schedule_for_torch(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "zbv.csv"
    assert main(["simulate", "-s", "zb-v", "-p", "2", "-m", "4", "--torch-csv", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"wrote torch compute_only CSV: {path}" in out
    assert "torchtitan: 2 stages per rank, in a V: pipeline_parallel_schedule ZBVZeroBubble" in out
    assert path.read_text() == sw.to_torch_csv(sw.build_schedule("zb-v", 2, 4))


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["synthesize", "-p", "0", "-m", "4"], "--ranks must be >= 1"),
        (["synthesize", "-p", "2", "-m", "4", "--effort", "-3"], "--effort must be >= 0 (0: no local search), got -3"),
        (["synthesize", "-p", "2", "-m", "4", "--placement", "v"], "placement 'v' zig-zags two or more stages"),
        (["synthesize", "-p", "2", "-m", "4", "--f-time", "-1"], "--f-time must be a finite number"),
        (
            ["synthesize", "-p", "2", "-m", "4", "--torch-csv", "a-file/x.csv"],
            "--torch-csv a-file/x.csv: cannot make its folder (a-file is a file)",
        ),
        (
            ["simulate", "-s", "1f1b", "-p", "2", "-m", "4", "--png", "a-file/sub/g.png"],
            "--png a-file/sub/g.png: cannot make",
        ),
        (["simulate", "-s", "pipedream", "-p", "2", "-m", "4", "--torch-csv", "x.csv"], "asynchronous"),
    ],
)
def test_bad_arguments_exit_2_naming_them(
    argv: list[str], words: str, capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    Path("a-file").write_text("")  # a file where a folder is asked for
    assert main(argv) == 2
    assert words in capsys.readouterr().err
