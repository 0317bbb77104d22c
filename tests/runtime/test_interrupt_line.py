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
