"""Checkpoints across layouts and processes: save at pp=2, load at pp=4, pp=2 zb-v and in one process; resume.

Four torchrun jobs share one folder, in order (tests/distributed/workers/checkpoint_checks.py):
``save2`` (2 ranks) saves at pp=2; ``save4`` (4 ranks, fresh processes) loads
those at pp=4 and saves at pp=4 and pp2 x dp2; ``resume2`` and ``resume4``
(fresh processes again) load and continue. The saves run in the shared 2- and
4-rank jobs (helpers.torchrun.shared_job; the 2-rank one runs first, in file
order), the resumes in jobs of their own after both. This process writes the
one-process "seed checkpoint" first (before the first of those jobs) and loads
the pp=2 checkpoint into the one-process model at the end.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import checkpoint_checks as cc
import checkpoint_models as cm
import hybrid_checks as hc
import stagewise as sw
from checkpoint_models import adamw, plain, tied_wrapped
from helpers import models as mdl
from helpers.torchrun import Share, SuiteResults, run_suite, shared_results

ORDER = [("save2", 2), ("save4", 4), ("resume2", 2), ("resume4", 4)]
CHECKS = [(suite, name) for suite, _ in ORDER for name in cc.suites(4)[suite]]
_FOLDER: list[Path] = []


def _folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder the four jobs share, the one-process seed checkpoint in it: made once, by the first that needs it."""
    if not _FOLDER:
        folder = tmp_path_factory.mktemp("ckpt")
        sw.checkpoint.save(folder / "seed", sw.build_model(plain(), seed=42), step=0)
        os.environ["STAGEWISE_CKPT_DIR"] = str(folder)  # where checkpoint_checks' references are read here too
        _FOLDER.append(folder)
    return _FOLDER[0]


def _env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return {"STAGEWISE_CKPT_DIR": str(_folder(tmp_path_factory))}


#: the saves in the shared jobs (the checks' default suite at 2 and 4 ranks), the resumes in fresh processes after
SHARE = tuple(Share("checkpoint_checks", tuple(cc.suites(r)[f"save{r}"]), 300, env=_env, ranks=r) for r in (2, 4))


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _folder(tmp_path_factory)


@pytest.fixture(scope="module")
def results(
    request: pytest.FixtureRequest, shared: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, SuiteResults]:
    done = {f"save{s.ranks}": shared_results(request.session, tmp_path_factory, s) for s in SHARE}
    env = {"STAGEWISE_CKPT_DIR": str(shared), "PYTHONWARNINGS": "ignore"}
    for suite, ranks in ORDER[2:]:
        out = tmp_path_factory.mktemp(suite)
        done[suite] = run_suite("checkpoint_checks", ranks, out, timeout=300, suite=suite, env=env)
    return done


@pytest.mark.parametrize(("suite", "name"), CHECKS)
def test_check(results: dict[str, SuiteResults], suite: str, name: str) -> None:
    results[suite].assert_ok(name)


def test_resumed_losses_are_the_uninterrupted_ones(results: dict[str, SuiteResults]) -> None:
    """The same four losses, to the last bit, whether the run stopped after two steps or not (fresh processes)."""
    for saver, resumer in [
        ("save-1f1b-dropout", "resume-1f1b"),
        ("save-zbv-dropout-user-optimizer", "resume-zbv-user-optimizer"),
    ]:
        saved = results["save2"].get(saver)[0]["info"]["losses"]
        resumed = results["resume2"].get(resumer)[0]["info"]["losses"]
        assert resumed == saved[2:], (saver, saved, resumed)
    saved = results["save4"].get("save-pp2xdp2")[0]["info"]["losses"]
    assert results["resume4"].get("resume-pp2xdp2")[0]["info"]["losses"] == saved[2:]


def test_load_pp2_checkpoint_into_one_process(results: dict[str, SuiteResults], shared) -> None:
    """The pp=2 checkpoint (per-stage optimizers) into sw.build_model and one AdamW: parameters and state by name."""
    results["save2"].assert_ok("save-pp2-1f1b")
    model = sw.build_model(plain(), seed=123)
    opt = adamw(list(model.parameters()))
    info = sw.checkpoint.load(shared / "p2", model, opt)
    assert info.step == 2 and info.layout["pipeline"]["ranks"] == 2 and not info.rng_restored
    assert cc.assert_same(model, [opt], "p2") == len(list(model.parameters()))


def test_compiled_layers_train_as_one_process_and_their_checkpoint_loads_uncompiled(
    results: dict[str, SuiteResults], shared
) -> None:
    """Layers under torch.compile (pp 2, ZB-V's split backward) train as the plain layers do in one process, and
    their checkpoint names the tensors without compile's ``_orig_mod`` (as torch.distributed.checkpoint's
    state-dict helpers do): it loads strictly into the uncompiled one-process model and its AdamW."""
    results["save2"].assert_ok("save-compiled-zbv")
    record = (sw.checkpoint.latest(shared / "comp") / "stagewise.json").read_text()
    assert "_orig_mod" not in record and '"model/1.qkv.weight"' in record
    reference = sw.build_model(plain(), seed=1)
    opt = adamw(list(reference.parameters()))
    for step in range(2):  # the saving job's two steps, in one process, uncompiled
        x, y = mdl.lm_data(cm.BATCH, seed=100 + step)
        opt.zero_grad()
        mdl.lm_loss(reference(x), y).backward()
        opt.step()
    model = sw.build_model(plain(), seed=123)
    loaded = adamw(list(model.parameters()))
    info = sw.checkpoint.load(shared / "comp", model, loaded)  # strict: every name and optimizer entry found
    assert info.step == 2 and info.optimizer_restored
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12, msg=f"{name} after the compiled pipeline's steps")
        torch.testing.assert_close(loaded.state[p]["exp_avg_sq"], opt.state[q]["exp_avg_sq"], rtol=1e-9, atol=1e-18)
    saved, _, _ = cc.reference("comp")  # what the pipeline itself held: compile's names, the same values
    assert saved and all("._orig_mod." in n for n in saved)
    held = dict(model.named_parameters())
    assert all(torch.equal(held[n.replace("._orig_mod", "")], v) for n, v in saved.items())


def test_load_sharded_checkpoint_into_one_process(results: dict[str, SuiteResults], shared) -> None:
    """FSDP2 shards (pp 2 x sharding 2, DTensors) gathered by DCP into the plain one-process model."""
    results["save4"].assert_ok("save-pp2xsharding2")
    model = sw.build_model(hc.tp_lm(), seed=5)
    info = sw.checkpoint.load(shared / "sh", model)
    assert info.layout["parallel"] == {"pp": 2, "dp": 1, "sharding": 2, "tp": 1}
    assert cc.assert_same(model, [], "sh", optim=False) == len(list(model.parameters()))


def test_tied_module_with_a_wrapped_first_use_loads_into_one_process(results: dict[str, SuiteResults], shared) -> None:
    """Rank 1's tied copy is named as the one-process model names it (``0.module.weight``), optimizer state too."""
    results["save2"].assert_ok("save-tied-wrapped-pp2")
    record = (sw.checkpoint.latest(shared / "tiedw") / "stagewise.json").read_text()
    assert '"optim/0.module.weight/exp_avg"' in record and '"optim/0.weight/' not in record
    model = sw.build_model(tied_wrapped(), seed=3)
    opt = adamw(list(model.parameters()))
    sw.checkpoint.load(shared / "tiedw", model, opt)  # strict: every optimizer entry has its parameter here
    state = opt.state[model.get_submodule("0").module.weight]
    assert int(state["step"]) == 2 and state["exp_avg"].abs().sum() > 0


def test_found_tie_loads_into_one_process(results: dict[str, SuiteResults], shared) -> None:
    """A tie ``from_model`` found (``head.weight = embed.weight``), saved at pp 2 where rank 1 holds only the head:
    its optimizer state is under ``embed.weight`` alone, as one process keys it, and loads strictly there."""
    results["save2"].assert_ok("save-found-tie-1f1b")
    record = (sw.checkpoint.latest(shared / "ftie") / "stagewise.json").read_text()
    assert '"optim/embed.weight/exp_avg"' in record and '"optim/head.weight/' not in record
    torch.manual_seed(3)
    model = cc.FoundTie()
    opt = adamw(list(model.parameters()))
    sw.checkpoint.load(shared / "ftie", model, opt)  # strict
    assert cc.assert_same(model, [opt], "ftie") == 1 + 4 * 2


def test_tied_pipeline_loss_equals_one_process(results: dict[str, SuiteResults]) -> None:
    info = results["resume2"].get("tied-restore-pp2")[0]["info"]
    assert info["pipeline"] == pytest.approx(info["one_process"], rel=1e-12, abs=0)
    assert torch.isfinite(torch.tensor(info["pipeline"]))
