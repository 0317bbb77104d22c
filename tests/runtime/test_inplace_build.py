"""sw.runtime.InPlace builds a generation after a change of members as ``pipe.relayout`` builds its new layout: inside
``built_empty`` (layer specs on ``meta``, given storage, no initialisation computed), then filled by the take-over or
the resume; the filled pipeline equals one built as usual and resumed from the same state, bit for bit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import stagewise as sw
from helpers.models import CountedNorm
from stagewise.runtime.checkpoint import state
from stagewise.runtime.checkpoint.resume import resume
from stagewise.runtime.relayout import generation
from stagewise.runtime.relayout.takeover import hold


def _job(tmp_path: Path, microbatch_size: int = 2) -> generation.InPlace:
    def build(fit: Any) -> sw.Pipeline:
        layers = [
            sw.Layer(nn.Linear, 4, 8, dtype=torch.float64),
            sw.Layer(CountedNorm, 8, dtype=torch.float64),
            sw.Layer(nn.Dropout, 0.2),
            sw.Layer(nn.Linear, 8, 3, dtype=torch.float64),
        ]
        return sw.Pipeline(
            layers, loss_fn=F.cross_entropy, microbatches=fit.microbatches, seed=3, timeout=5,
            optimizer=lambda ps: torch.optim.Adam(ps, lr=0.05),
            snapshot=sw.Snapshots(every=1, folder=str(tmp_path / "shm")),
        )  # fmt: skip

    layout = sw.ElasticLayout(pp=1, batch=4, microbatch_size=microbatch_size)
    return generation.InPlace(layout, build, tmp_path / "ckpt", timeout=5)


def _state(pipe: sw.Pipeline) -> dict[str, torch.Tensor]:
    tensors = {state.MODEL + k: t.detach() for k, t in state.load_targets(pipe).items()}
    optim, _ = state.optimizer_state(state.optimizers_of(pipe, None), state.parameter_names(pipe))
    return {**tensors, **optim}


def test_a_new_generation_is_built_on_meta_and_filled_with_no_initialisation(one_rank: object, tmp_path: Path) -> None:
    x = torch.randn(4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    y = torch.tensor([0, 1, 2, 0])
    job = _job(tmp_path)
    old = job._build(1, empty=False)
    assert CountedNorm.real_inits > 0  # (the counter counts: a usual build initialises)
    for _ in range(2):
        old.train_step(x, y)
    assert old.snapshots is not None
    old.snapshots.wait()
    job.pipe, job._held = old, hold(old)
    del old
    job._drop_pipeline(None)
    CountedNorm.real_inits = 0
    job.layout = _job(tmp_path, microbatch_size=1).layout  # another layout: the take-over fills (not the resume)
    job.pipe = job._build(1, empty=True)
    assert CountedNorm.real_inits == 0, "the new generation's build initialised its layers before the fill"
    assert job._restore(1) == 2
    assert job._sources["path"] == "live" and job._sources["kept"] > 0, job._sources
    new: sw.Pipeline = job.pipe
    reference = _job(tmp_path, microbatch_size=1)._build(1, empty=False)  # as usual, resumed from the same files
    info = resume(tmp_path / "ckpt", reference)
    assert info is not None and info.step == 2
    got, want = _state(new), _state(reference)
    assert sorted(got) == sorted(want)
    different = [n for n in want if not torch.equal(got[n], want[n])]
    assert different == [], different
    assert (new.train_steps, new.dropout_seed) == (reference.train_steps, reference.dropout_seed)
    assert new.train_step(x, y) == reference.train_step(x, y)  # float64, to the bit (Dropout draws alike)


@pytest.mark.parametrize("empty", [True, False])
def test_a_generation_with_nothing_to_resume_is_built_again_as_usual(
    one_rank: object, tmp_path: Path, empty: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No snapshot and no checkpoint (a fresh start at a later generation): the empty build is not trained from
    uninitialised storage; the build that initialises replaces it."""
    job = _job(tmp_path)
    built: list[bool] = []
    real = job._build
    monkeypatch.setattr(job, "_build", lambda size, empty: built.append(empty) or real(size, empty))
    monkeypatch.setattr(job, "_restore", lambda generation: None)
    monkeypatch.setattr(generation, "join_generation", lambda *a: None)
    monkeypatch.setattr(job, "_members", type("M", (), {"members": [0], "rank": 0, "generation": 1})())
    job._enter(1 if empty else 0)
    assert built == ([True, False] if empty else [False]) and job.step == 0
    assert all(p.device.type == "cpu" for p in job.pipe.parameters())
