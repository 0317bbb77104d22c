"""stagewise.checkpoint's safety in one process (issue 32): the metadata unpickler's fixed list of classes, the
rank-by-rank shares DCP writes (each piece once) merged back on load, and which checkpoint a root resolves to."""

from __future__ import annotations

import logging
import pickle
import shutil
import traceback
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.planner import WriteItemType

import stagewise as sw
from helpers import models as mdl
from stagewise.checkpoint import CheckpointError
from stagewise.runtime.checkpoint import dcp_files, storage

CPU = torch.device("cpu")


def test_the_metadata_unpickler_builds_only_its_fixed_list(tmp_path: Path) -> None:
    """A class of DCP's own package that is not DCP metadata (the old rule allowed any class under it) is refused."""
    (tmp_path / ".metadata").write_bytes(pickle.dumps(WriteItemType.TENSOR))
    with pytest.raises(CheckpointError, match="refusing to build torch.distributed.checkpoint.planner.WriteItemType"):
        dcp_files.SafeReader(str(tmp_path)).read_metadata()


def test_shares_write_each_piece_once_and_load_merged(tmp_path: Path) -> None:
    """Two ranks' shares (no process group: the collectives are not needed to write them): ``b``, held by both,
    is written by rank 0 alone; a load reads every name from the share that wrote it."""
    held = [
        {"a": torch.arange(4.0), "b": torch.full((2, 3), 7.0, dtype=torch.float64)},
        {"b": torch.full((2, 3), 7.0, dtype=torch.float64), "c": torch.tensor(5)},
    ]
    pieces = [storage.pieces(t) for t in held]
    for rank, tensors in enumerate(held):
        ranks = storage.Ranks(None, rank, 2, CPU, True)
        storage.save_tensors(tensors, tmp_path, ranks, storage.assigned(pieces, rank))
    meta = dcp_files.SafeReader(str(tmp_path)).read_metadata()
    files = {index.fqn: info.relative_path for index, info in meta.storage_data.items()}
    assert sorted(files) == ["a", "b", "c"] and files["b"].startswith("rank-0/") and files["c"].startswith("rank-1/")
    targets = {"a": torch.zeros(4), "b": torch.zeros(2, 3, dtype=torch.float64), "c": torch.tensor(0)}
    storage.load_tensors(targets, tmp_path, storage.Ranks(None, 0, 1, CPU, False))
    assert torch.equal(targets["a"], held[0]["a"]) and torch.equal(targets["b"], held[1]["b"]) and targets["c"] == 5


def test_a_root_whose_newest_checkpoint_lost_its_manifest_is_refused_not_passed_over(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = sw.build_model(mdl.lm(2), seed=0)
    sw.checkpoint.save(tmp_path, model, step=1, collective=False)
    second = sw.checkpoint.save(tmp_path, model, step=2, collective=False)
    (second / "MANIFEST.json").unlink()
    words = "step-00000002, is incomplete: it has no MANIFEST.json .* move step-00000002 away"
    with pytest.raises(CheckpointError, match=words):
        sw.checkpoint.load(tmp_path, model, collective=False)
    with pytest.raises(CheckpointError, match=words):
        sw.checkpoint.resume(tmp_path, model, collective=False)
    shutil.move(second, tmp_path / "damaged")
    shutil.copytree(tmp_path / "step-00000001", tmp_path / ".step-00000005.tmp")  # a save that died
    with caplog.at_level(logging.INFO, logger="stagewise"):
        info = sw.checkpoint.resume(tmp_path, model, collective=False)
    assert info is not None and info.step == 1
    assert "the newest of 1 complete checkpoint under" in info.reason, info.reason
    assert "an interrupted save of step 5 is ignored: .step-00000005.tmp" in info.reason, info.reason
    assert f"step-00000001: {info.reason}" in caplog.text, caplog.text
    assert sw.checkpoint.resume(tmp_path / "nowhere", model, collective=False) is None


def _dcp_failure(exc: BaseException) -> BaseException:
    from torch.distributed.checkpoint.api import CheckpointException

    return CheckpointException("dcp", {0: (exc, traceback.StackSummary())})


def test_what_dcp_wraps_is_handed_on_as_what_it_was() -> None:
    """A Ctrl-C during a save stays a KeyboardInterrupt (the job's one line, no traceback); a disk error becomes a
    CheckpointError naming the folder; a CheckpointError from the reader stays itself."""
    with pytest.raises(KeyboardInterrupt):
        with dcp_files._unwrapped("writing checkpoint ckpt/step-3"):
            raise _dcp_failure(KeyboardInterrupt())
    with pytest.raises(CheckpointError, match=r"^writing checkpoint ckpt/step-3: OSError: \[Errno 28\] disk full$"):
        with dcp_files._unwrapped("writing checkpoint ckpt/step-3"):
            raise _dcp_failure(OSError(28, "disk full"))
    with pytest.raises(CheckpointError, match="^refusing to build x$"):
        with dcp_files._unwrapped("reading checkpoint ckpt/step-3"):
            raise _dcp_failure(CheckpointError("refusing to build x"))


def test_a_resume_from_a_missing_root_beside_a_near_name_that_holds_checkpoints_warns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = sw.build_model(mdl.lm(2), seed=0)
    sw.checkpoint.save(tmp_path / "ckpts", model, step=3, collective=False)
    (tmp_path / "ckpt-notes").mkdir()  # a near name with no checkpoint in it: no evidence
    for series in ("run2", "ck_lterm"):  # another job's folder beside a new one: a series, no typo (a user pass)
        sw.checkpoint.save(tmp_path / series, model, step=1, collective=False)
    with caplog.at_level(logging.INFO, logger="stagewise"):
        assert sw.checkpoint.resume(tmp_path / "ckpt", model, collective=False) is None  # a typo: afresh, said
        assert sw.checkpoint.resume(tmp_path / "runs", model, collective=False) is None  # a job's first run
        for new in ("run3", "ck_r0term"):
            assert sw.checkpoint.resume(tmp_path / new, model, collective=False) is None
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warned == [
        f"stagewise.checkpoint.resume: starting afresh: no {tmp_path / 'ckpt'}, but "
        f"{tmp_path / 'ckpts'} holds checkpoints: a misspelt path?"
    ], warned
