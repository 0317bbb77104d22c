"""The line Ctrl-C prints (stagewise.runtime.interrupt): the rank furthest behind, the newest checkpoint."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from stagewise.runtime import interrupt


def test_the_line_names_the_rank_furthest_behind_and_the_newest_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # a checkpoint under the working directory is named relative to it
    ckpt = tmp_path / "ckpt"
    records = [
        {"rank": 0, "steps": 9, "checkpoint": str(ckpt / "step-00000009")},
        {"rank": 1, "steps": 8, "checkpoint": str(ckpt / "step-00000006")},
        {"rank": 2, "steps": 8, "checkpoint": None},
    ]
    line = interrupt.summary(records)
    assert (
        line == f"interrupted: rank 1 stopped after step 8; last checkpoint {os.path.relpath(ckpt / 'step-00000009')}"
    )
    assert interrupt.summary([{"rank": 3, "steps": 0, "checkpoint": None}]) == (
        "interrupted: rank 3 stopped after step 0; no checkpoint saved"
    )
    assert interrupt.summary([]).startswith("interrupted: no rank said where it stopped")


def test_a_worker_counts_its_steps_and_hands_its_record_to_the_launcher(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(interrupt, "_state", {"steps": 0, "checkpoint": None})
    monkeypatch.setenv("RANK", "1")
    interrupt.note_steps()
    interrupt.note_checkpoint(tmp_path / "step-00000010", 10, loaded=True)  # a resumed job counts on from it
    interrupt.note_steps(2)
    with interrupt.uncounted():  # a probe's steps (calibrate) are not the job's
        interrupt.note_steps(5)
    monkeypatch.setenv(interrupt.FOLDER_ENV, str(tmp_path))
    interrupt.stopped()
    (record,) = interrupt.records(tmp_path)
    assert record == {"rank": 1, "steps": 12, "checkpoint": str(tmp_path / "step-00000010")}
    assert json.loads((tmp_path / "rank-1.json").read_text()) == record


def test_the_first_cause_a_worker_hands_over_stands_per_attempt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every rank that learns of a failure hands it over; the first one written stands (the launcher prints its
    first line last); a restart attempt has its own, and the launcher reads the last attempt's."""
    monkeypatch.setenv(interrupt.FOLDER_ENV, str(tmp_path))
    assert interrupt.first_cause(tmp_path) is None
    interrupt.note_cause("rank 1 at 1F0: ValueError: boom\nrank 1 at 1F0 (action 3 of 9)")
    interrupt.note_cause("rank 1 at 1F0: ValueError: boom, as rank 0 read it")
    assert interrupt.first_cause(tmp_path) == "rank 1 at 1F0: ValueError: boom"
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    interrupt.note_cause("rank 2: RuntimeError: the second attempt's")
    assert interrupt.first_cause(tmp_path) == "rank 2: RuntimeError: the second attempt's"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cause-0.txt", "cause-1.txt"]  # no partial file left


def test_stagewise_run_prints_the_first_cause_as_its_last_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch.distributed.run
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from stagewise.runtime.launch import torchrun

    def failed_job(argv: list[str]) -> None:  # a worker handed its cause over, then torchrun reports the exits
        interrupt.note_cause("rank 1 at 1F0: ValueError: the layer on rank 1 raised\nrank 1 at 1F0 (action 3)")
        raise ChildFailedError("train.py", {1: ProcessFailure(1, 1234, 1, "<N/A>")})

    monkeypatch.setattr(torch.distributed.run, "main", failed_job)
    assert torchrun(["--standalone", "--nproc-per-node=2", "train.py"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert "Root Cause" in "\n".join(err)
    assert err[-1] == "stagewise run: rank 1 at 1F0: ValueError: the layer on rank 1 raised"
