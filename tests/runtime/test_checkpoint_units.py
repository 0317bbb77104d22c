"""stagewise.checkpoint in one process (no process group): round trip, refusals, retention, the safe unpickler."""

from __future__ import annotations

import os
import pickle
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import stagewise as sw
from helpers import models as mdl
from stagewise.checkpoint import CheckpointError
from stagewise.runtime.checkpoint import dcp_files


def _trained(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    model = sw.build_model(mdl.lm(2), seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.9))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    x, y = mdl.lm_data(4, seed=1)
    mdl.lm_loss(model(x), y).backward()
    opt.step()
    sched.step()
    return model, opt, sched


def test_round_trip_restores_model_optimizer_scheduler_rng_and_extra(tmp_path: Path) -> None:
    model, opt, sched = _trained()
    random.seed(3)
    torch.manual_seed(4)
    where = sw.checkpoint.save(tmp_path, model, opt, step=7, extra={"epoch": 1, "index": (2, 3)}, scheduler=sched)
    assert where == tmp_path / "step-00000007" and sw.checkpoint.latest(tmp_path) == where
    expected = (torch.rand(3), random.random())
    other, opt2, sched2 = _trained(seed=9)
    opt2.param_groups[0]["betas"] = (0.5, 0.5)
    info = sw.checkpoint.load(tmp_path, other, opt2, scheduler=sched2)
    assert (torch.rand(3).tolist(), random.random()) == (expected[0].tolist(), expected[1])
    assert info.step == 7 and info.extra == {"epoch": 1, "index": (2, 3)} and info.rng_restored
    assert info.versions["torch"] == torch.__version__ and info.layout == {"world": 1, "pipeline": None}
    for (name, a), b in zip(model.state_dict().items(), other.state_dict().values()):
        assert torch.equal(a, b), name
    assert opt2.param_groups[0]["betas"] == (0.8, 0.9) and opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    assert sched2.state_dict() == sched.state_dict()
    for p, q in zip(model.parameters(), other.parameters()):
        for key, value in opt.state[p].items():
            assert torch.equal(value, opt2.state[q][key]), key


def test_a_flipped_byte_an_unlisted_file_or_a_missing_file_is_refused_naming_it(tmp_path: Path) -> None:
    model, opt, _ = _trained()
    good = sw.checkpoint.save(tmp_path / "good", model, opt, step=1)
    cases = {}
    for case in ("flipped", "unlisted", "missing", "record"):
        cases[case] = shutil.copytree(good, tmp_path / case)
    data = sorted(cases["flipped"].glob("*.distcp"))[0]
    raw = bytearray(data.read_bytes())
    raw[-10] ^= 0x80
    data.write_bytes(bytes(raw))
    (cases["unlisted"] / "notes.txt").write_text("hello")
    (cases["missing"] / ".metadata").unlink()
    record = cases["record"] / "stagewise.json"
    record.write_text(record.read_text().replace('"step": 1', '"step": 2'))
    fresh = sw.build_model(mdl.lm(2), seed=5)
    before = [p.detach().clone() for p in fresh.parameters()]
    for case, words in {
        "flipped": [str(data), "corrupted", "sha256"],
        "unlisted": [str(cases["unlisted"] / "notes.txt"), "not in the manifest"],
        "missing": [str(cases["missing"] / ".metadata"), "missing"],
        "record": [str(record), "corrupted"],
    }.items():
        with pytest.raises(CheckpointError) as err:
            sw.checkpoint.load(cases[case], fresh)
        for w in words:
            assert w in str(err.value), (case, str(err.value))
    assert all(torch.equal(a, b) for a, b in zip(before, fresh.parameters()))  # untouched


def test_a_partial_folder_is_not_the_latest_and_is_refused(tmp_path: Path) -> None:
    model, _, _ = _trained()
    sw.checkpoint.save(tmp_path, model, step=1)
    second = sw.checkpoint.save(tmp_path, model, step=2)
    (second / "MANIFEST.json").unlink()
    assert sw.checkpoint.latest(tmp_path) == tmp_path / "step-00000001"
    with pytest.raises(CheckpointError, match="partial"):
        sw.checkpoint.load(second, model)
    assert sw.checkpoint.latest(tmp_path / "nowhere") is None
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        sw.checkpoint.load(tmp_path / "nowhere", model)


def test_keep_prunes_the_oldest_and_never_a_later_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``keep=2`` keeps the save and the newest one before it. A later step than the one saved is another run's
    (one that forgot to resume: it saved step 2 with ``keep=1`` and step 100 was deleted, 2026-12-06): kept, and
    the save warns that a resume takes it; another job's save of a step replaced says so (a job's own, a step
    redone after a loss, does not)."""
    import warnings

    model, _, _ = _trained()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "first-job")
    for step in (1, 3, 5, 9):
        sw.checkpoint.save(tmp_path, model, step=step, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000005", "step-00000009"]
    with pytest.warns(UserWarning, match=r"holds later steps \(5, 9\): a resume takes step 9, not this one"):
        sw.checkpoint.save(tmp_path, model, step=2, keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000002", "step-00000005", "step-00000009"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sw.checkpoint.save(tmp_path, model, step=9)  # the same job's again: nothing to say
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "second-job")
    with pytest.warns(UserWarning, match="replaced an earlier save of the same step"):
        sw.checkpoint.save(tmp_path, model, step=9, keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000009"]
    with pytest.raises(ValueError, match="keep must be"):
        sw.checkpoint.save(tmp_path, model, step=10, keep=0)
    with pytest.raises(ValueError, match="step must be"):
        sw.checkpoint.save(tmp_path, model, step=-1)


def test_another_model_is_refused_naming_the_tensors_unless_not_strict(tmp_path: Path) -> None:
    model, trained_opt, _ = _trained()
    sw.checkpoint.save(tmp_path, model, trained_opt, step=1)
    bigger = sw.build_model(mdl.lm(3), seed=1)
    with pytest.raises(CheckpointError) as err:
        sw.checkpoint.load(tmp_path, bigger)
    assert "'3.qkv.weight' of the model is missing" in str(err.value)
    smaller = sw.build_model(mdl.lm(1), seed=1)
    with pytest.raises(CheckpointError, match="'2.qkv.weight' is in the checkpoint but not in the model"):
        sw.checkpoint.load(tmp_path, smaller)
    opt = torch.optim.AdamW(bigger.parameters(), lr=1.0)
    sw.checkpoint.load(tmp_path, bigger, opt, strict=False)  # the names both have: the first blocks
    assert torch.equal(bigger.get_submodule("1").qkv.weight, model.get_submodule("1").qkv.weight)
    assert opt.state[bigger.get_submodule("1").qkv.weight]["step"] == 1  # (saved after one AdamW step)
    assert not opt.state[bigger.get_submodule("3").qkv.weight]  # not in the checkpoint: fresh
    single = sw.build_model(mdl.lm(2, dtype=torch.float32), seed=1)  # the same model in another dtype
    with pytest.raises(CheckpointError, match=r"'1.qkv.weight': the checkpoint holds it in float64, the model in "
                       r"float32 \(the same shape, \(48, 16\)\): build the model in float64 to load it"):  # fmt: skip
        sw.checkpoint.load(tmp_path, single)
    narrow = sw.build_model(mdl.lm(2), seed=1)
    narrow.get_submodule("1").qkv = torch.nn.Linear(16, 24, dtype=torch.float64)
    with pytest.raises(CheckpointError, match=r"'1.qkv.weight': the checkpoint has shape \(48, 16\) float64, the "
                       r"model \(24, 16\) float64"):  # fmt: skip
        sw.checkpoint.load(tmp_path, narrow)


def test_an_optimizer_over_foreign_parameters_or_none_saved_is_refused(tmp_path: Path) -> None:
    model, _, _ = _trained()
    stray = torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=0.1)
    with pytest.raises(CheckpointError, match="that the model does not have"):
        sw.checkpoint.save(tmp_path, model, stray, step=1)
    sw.checkpoint.save(tmp_path, model, step=1)
    with pytest.raises(CheckpointError, match="holds no optimizer state"):
        sw.checkpoint.load(tmp_path, model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_the_metadata_unpickler_builds_nothing_but_dcp_metadata(tmp_path: Path) -> None:
    model, _, _ = _trained()
    where = sw.checkpoint.save(tmp_path, model, step=1)
    assert dcp_files.SafeReader(str(where)).read_metadata().state_dict_metadata  # DCP's own metadata reads
    (where / ".metadata").write_bytes(pickle.dumps(os.getcwd))
    with pytest.raises(CheckpointError, match="refusing to build"):
        dcp_files.SafeReader(str(where)).read_metadata()


def test_a_save_removes_the_half_written_saves_of_its_own_job_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save that died half-way (a restart's, a lost machine's) leaves ``.step-N.tmp``: the same job's next save
    removes it; another job's (which may be writing now) and an unclaimed one stay."""
    from stagewise.runtime.checkpoint import retention

    model = sw.build_model(mdl.lm(2), seed=0)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
    for job, step in (("job-a", 40), ("job-b", 41)):
        staging = retention.staging_for(tmp_path, step)
        staging.mkdir()
        (staging / "rank-0").mkdir()
        retention.claim(staging, job)
    retention.staging_for(tmp_path, 42).mkdir()  # no claim: left alone
    orphan = retention.staging_for(tmp_path, 39).with_name(".step-00000039.tmp.owner")
    orphan.write_text('{"job": "job-b"}')  # a claim whose save was published, interrupted before its sweep
    sw.checkpoint.save(tmp_path, model, step=48, collective=False)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == [".step-00000041.tmp", ".step-00000041.tmp.owner", ".step-00000042.tmp", "step-00000048"]


def test_a_published_save_is_noted_and_its_claim_removed_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Ctrl-C after the rename but before the save returned left the interrupt line naming the step before, and
    the claim beside the published folder for good (a user pass): both happen with the rename now."""
    from stagewise.runtime import interrupt
    from stagewise.runtime.checkpoint import api, retention

    def interrupted(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(retention, "sweep", interrupted)  # the first thing after the publish
    model = sw.build_model(mdl.lm(2), seed=0)
    with pytest.raises(KeyboardInterrupt):
        api.save(tmp_path, model, step=15, collective=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000015"]
    assert interrupt.where()["checkpoint"] == str(tmp_path / "step-00000015")


def _two_stages(seed: int) -> tuple[torch.nn.Module, dict[int, torch.optim.Optimizer], dict[int, Any]]:
    """A model whose two halves have their own optimizers with different learning rates, and one warm-up rule
    stepping both in lockstep (as a pipeline's ``lr_scheduler=`` does per stage)."""
    model = sw.build_model(mdl.lm(2), seed=seed)
    params = list(model.parameters())
    half = len(params) // 2
    opts = {0: torch.optim.SGD(params[:half], lr=0.5), 1: torch.optim.SGD(params[half:], lr=0.03)}
    scheds = {s: torch.optim.lr_scheduler.LambdaLR(o, lambda step: (step + 1) / 4) for s, o in opts.items()}
    return model, opts, scheds


def test_schedulers_in_lockstep_each_keep_their_own_stage_s_rates(tmp_path: Path) -> None:
    """The saved position goes to every stage's scheduler, its base LR does not: each stage goes on at its own."""
    model, opts, scheds = _two_stages(0)
    for _ in range(2):
        for s in (0, 1):
            opts[s].step()
            scheds[s].step()
    sw.checkpoint.save(tmp_path, model, opts, step=2, scheduler=scheds)
    other, opts2, scheds2 = _two_stages(9)
    sw.checkpoint.load(tmp_path, other, opts2, scheduler=scheds2)
    for s in (0, 1):
        assert scheds2[s].get_last_lr() == scheds[s].get_last_lr(), s
        opts[s].step(), opts2[s].step()
        scheds[s].step(), scheds2[s].step()
        assert scheds2[s].state_dict() == scheds[s].state_dict(), s
        assert opts2[s].param_groups[0]["lr"] == opts[s].param_groups[0]["lr"] == [0.5, 0.03][s] * 4 / 4, s


def test_another_optimizer_class_is_refused_before_anything_changes(tmp_path: Path) -> None:
    """An AdamW checkpoint loaded into an SGD said ``optimizer_restored=True`` and left the SGD with AdamW's
    weight decay, learning rate and moments (2026-12-06): refused now, naming both classes, nothing loaded;
    ``optimizer=[]`` loads the model alone."""
    model, opt, _ = _trained()
    sw.checkpoint.save(tmp_path, model, opt, step=1)
    fresh = sw.build_model(mdl.lm(2), seed=5)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    sgd = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(CheckpointError, match="optimizer state is AdamW's, and this optimizer is SGD"):
        sw.checkpoint.load(tmp_path, fresh, sgd)
    assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items())  # nothing changed
    assert sgd.param_groups[0]["lr"] == 0.1 and not sgd.state
    info = sw.checkpoint.load(tmp_path, fresh, [])
    assert not info.optimizer_restored
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in fresh.state_dict().items())
    again = torch.optim.AdamW(fresh.parameters(), lr=1.0)
    assert sw.checkpoint.load(tmp_path, fresh, again).optimizer_restored and again.param_groups[0]["lr"] == 1e-2 * 0.5


def test_a_load_from_where_no_checkpoint_is_says_what_was_likely_meant(tmp_path: Path) -> None:
    """``step-8`` for ``step-00000008`` (the guides write ``step-N``), a HetPipe's root (its parts under ``vw0/``,
    ``vw1/``) loaded into one model, a near name of a root holding checkpoints, a missing folder and a file: each
    refusal says which."""
    model, opt, _ = _trained()
    sw.checkpoint.save(tmp_path / "run", model, opt, step=8, collective=False)
    for k in (0, 1):
        sw.checkpoint.save(tmp_path / "het" / f"vw{k}", model, opt, step=4, collective=False)
    (tmp_path / "file").write_text("")
    said = {
        "run/step-8": f"step folders are named with 8 digits: {tmp_path / 'run' / 'step-00000008'}",
        "het": f"it holds checkpoints in parts (vw0, vw1: a HetPipe saves each virtual worker's pipeline under "
        f"its own folder): load it into the same HetPipe, or one part ({tmp_path / 'het' / 'vw0'}) into a Pipeline",
        "nowhere": "(no such folder)",
        "runs": f"{tmp_path / 'run'} holds checkpoints: a misspelt path?",  # (the resume's warning, shared)
        "file": "(a file, not a folder)",
    }
    for name, words in said.items():
        with pytest.raises(CheckpointError) as err:
            sw.checkpoint.load(tmp_path / name, model, opt, collective=False)
        assert str(err.value) == f"no checkpoint at {tmp_path / name}: neither a checkpoint folder nor a folder " + (
            f"holding step-* ones{'' if words.startswith('(') else ';'} {words}"
        ), str(err.value)
    sw.checkpoint.load(tmp_path / "het" / "vw0", model, opt, collective=False)  # the part the hint names loads
