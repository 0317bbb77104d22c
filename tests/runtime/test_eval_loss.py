"""Evaluation (issue 51 item 5): ``eval_loss`` is the one-process model's loss on every rank, and inputs of another
structure than training's are refused before the schedule runs. On a one-rank group (the replicas' average:
tests/distributed/workers/owned_checks.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import stagewise as sw
from helpers import models as mdl


class Masked(nn.Module):
    """Takes ``x`` or ``(x, mask)``: a model that would run either, so only the check can tell them apart."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(mdl.D, mdl.D, dtype=torch.float64)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.lin(x if mask is None else x * mask)


def _layers() -> list[sw.Layer]:
    return [sw.Layer(Masked), sw.Layer(nn.Tanh), sw.Layer(nn.Linear, mdl.D, mdl.CLASSES, dtype=torch.float64)]


def test_eval_loss_is_the_models_loss(one_rank) -> None:
    pipe = sw.Pipeline(mdl.mlp(), loss_fn=F.cross_entropy, schedule="zb-v", microbatches=3, seed=4)
    ref = sw.build_model(mdl.mlp(), seed=4)
    x, y = mdl.mlp_data(11, seed=3)
    with torch.no_grad():
        want = F.cross_entropy(ref(x), y).item()
    assert pipe.eval_loss(x, y) == pytest.approx(want, rel=1e-12)
    assert all(p.grad is None for p in pipe.parameters())  # forward only


def test_eval_loss_weighs_by_loss_weights(one_rank) -> None:
    """A token mean (ignore_index rows count nothing) stays the one-process token mean."""

    def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out, y, ignore_index=-100)

    def count(y: torch.Tensor) -> torch.Tensor:
        return (y != -100).sum()

    pipe = sw.Pipeline(mdl.mlp(), loss_fn=loss, loss_weights=count, microbatches=2, seed=4)
    ref = sw.build_model(mdl.mlp(), seed=4)
    x, y = mdl.mlp_data(9, seed=5)
    y[:4] = -100
    with torch.no_grad():
        want = loss(ref(x), y).item()
    assert pipe.eval_loss(x, y) == pytest.approx(want, rel=1e-12)


def test_eval_inputs_of_another_structure_are_refused(one_rank) -> None:
    pipe = sw.Pipeline(_layers(), loss_fn=F.cross_entropy, microbatches=2, seed=1)
    x, y = mdl.mlp_data(6, seed=0)
    pipe.train_step((x, torch.ones_like(x)), y)
    pipe.eval_step((x[:4], torch.ones_like(x[:4])))  # other sizes: fine
    with pytest.raises(ValueError, match=r"eval_step: the inputs differ from training's: trained on \(inputs\[0\]"):
        pipe.eval_step(x)


def test_eval_inputs_of_another_dtype_are_refused(one_rank) -> None:
    pipe = sw.Pipeline(_layers(), loss_fn=F.cross_entropy, microbatches=2, seed=1)
    x, y = mdl.mlp_data(6, seed=0)
    pipe.train_step(x, y)
    with pytest.raises(ValueError, match="float64 2-d.*float32 2-d"):
        pipe.eval_loss(x.float(), y)


def test_eval_loss_needs_a_loss(one_rank) -> None:
    pipe = sw.Pipeline(mdl.mlp(), microbatches=2)
    with pytest.raises(ValueError, match="eval_loss needs loss_fn="):
        pipe.eval_loss(*mdl.mlp_data(4, seed=0))


def test_eval_loss_without_targets_on_the_last_stage_is_posted_before_the_forwards(one_rank) -> None:
    """The other ranks wait for this rank's forwards and loss: the refusal is posted to the pipeline's board before
    either (so each raises it at once, where it waited out its timeout before), and nothing ran."""
    pipe = sw.Pipeline(mdl.mlp(), loss_fn=F.cross_entropy, microbatches=2, seed=4)
    x, y = mdl.mlp_data(4, seed=0)
    pipe.train_step(x, y)
    with pytest.raises(ValueError, match="rank 0 holds the last stage, so eval_loss needs the targets"):
        pipe.eval_loss(x, None)
    failure = pipe.transport.guard.failure
    assert failure is not None and "eval_loss needs the targets" in failure
    assert pipe.last_step is not None and pipe.last_step.mode == "train"  # refused before the forwards


def test_a_failing_loss_on_the_last_stage_is_posted(one_rank) -> None:
    """A loss_fn that raises on the last stage's rank, where the others wait for its loss: posted, then raised."""

    def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            raise RuntimeError("no evaluation here")
        return F.cross_entropy(out, y)

    pipe = sw.Pipeline(mdl.mlp(), loss_fn=loss, microbatches=2, seed=4)
    with pytest.raises(RuntimeError, match="no evaluation here"):
        pipe.eval_loss(*mdl.mlp_data(4, seed=0))
    failure = pipe.transport.guard.failure
    assert failure is not None and "RuntimeError: no evaluation here" in failure


def test_a_failure_before_the_actions_is_placed_before_them(one_rank) -> None:
    """The posted failure says the call failed before its actions ran, not where the previous step ended."""
    pipe = sw.Pipeline(mdl.mlp(), loss_fn=F.cross_entropy, microbatches=2, seed=4)
    x, y = mdl.mlp_data(6, seed=3)
    pipe.train_step(x, y)
    with pytest.raises(ValueError, match="2 micro-batches need at least 2 samples"):
        pipe.train_step(x[:1], y[:1])
    failure = pipe.transport.guard.failure
    assert failure is not None and failure.endswith("rank 0 in train_step, before its actions ran"), failure
    assert "planned:" not in failure, failure


def test_a_long_refusal_is_cut_for_the_other_ranks_saying_so() -> None:
    """The other ranks are told a refusal of at most WORDS_BYTES; a longer one says it was cut, and where."""
    from stagewise.runtime.engine import eval_inputs

    short = "inputs: a list of 2 tensors, expected 3"
    assert eval_inputs._told(short, 0) == short.encode()
    long = "é" * eval_inputs.WORDS_BYTES  # (two bytes each: the cut may split one, and decoding replaces it)
    told = eval_inputs._told(long, 2)
    assert len(told) == eval_inputs.WORDS_BYTES
    assert told.decode("utf-8", "replace").endswith("[... cut: rank 2 raised the whole refusal]")
    assert told.decode("utf-8", "replace").startswith("é" * 100)
