"""A loss that fails on an output and targets of unequal batch sizes says why that is likely: the rank holding
stage 0 and the rank holding the last stage were given different batches (mistakes pass, row 70: torch's
"Expected input batch_size (4) to match target batch_size (2)" was all a user read)."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from stagewise.runtime.engine.compute import Compute

pytestmark = pytest.mark.runtime


def _loss(out: torch.Tensor, targets: torch.Tensor, loss_fn=F.cross_entropy) -> torch.Tensor:  # type: ignore[no-untyped-def]
    compute = Compute({1: lambda x: x}, loss_fn, last=1)
    run = SimpleNamespace(record=SimpleNamespace(targets=[targets], losses={}), per_minibatch=4)
    return compute.loss(run, out, 0)  # type: ignore[arg-type]


def test_unequal_batches_are_named_with_the_global_sizes_and_the_error_keeps_its_type() -> None:
    out = torch.randn(4, 3, requires_grad=True)
    with pytest.raises(ValueError) as err:
        _loss(out, torch.arange(2) % 3)
    said = str(err.value)
    assert said.startswith(
        "stage 1, micro-batch 0: the model's output holds 4 samples and the targets 2: the ranks were given different "
        "batches (about 16 inputs on the rank holding stage 0, 8 targets here, in 4 micro-batches)?"
    ), said
    assert "Expected input batch_size (4) to match target batch_size (2)" in said  # torch's words kept, after ours
    assert isinstance(err.value.__cause__, ValueError)


def test_a_failure_with_equal_batches_is_the_loss_s_own() -> None:
    out = torch.randn(4, 3, requires_grad=True)
    with pytest.raises(IndexError, match=r"^Target 7 is out of bounds\.$"):
        _loss(out, torch.tensor([0, 1, 2, 7]))


def test_equal_batches_train_as_before() -> None:
    out = torch.randn(4, 3, requires_grad=True, dtype=torch.float64)
    targets = torch.tensor([0, 1, 2, 0])
    assert torch.equal(_loss(out, targets), F.cross_entropy(out, targets))


def test_targets_that_broadcast_against_the_output_into_pairs_of_samples_are_warned_of_once() -> None:
    """mse_loss of an (n, 1) output and (n,) targets pairs every sample with every other: a micro-batch's loss is
    then no part of the batch's (mistakes pass, row 7: the pipeline's loss 0.7966, one process's 1.0755)."""
    compute = Compute({1: lambda x: x}, F.mse_loss, last=1)
    out, targets = torch.randn(4, 1, requires_grad=True), torch.randn(4)
    run = SimpleNamespace(record=SimpleNamespace(targets=[targets, targets], losses={}), per_minibatch=2)
    with pytest.warns(UserWarning) as seen:
        compute.loss(run, out, 0)  # type: ignore[arg-type]
        compute.loss(run, out, 1)  # type: ignore[arg-type]
    ours = [str(w.message) for w in seen if str(w.message).startswith("stage 1:")]
    assert ours == [
        "stage 1: loss_fn gets an output of shape (4, 1) and targets of shape (4,), which broadcast to (4, 4): every "
        "sample is paired with every other of its micro-batch, so a micro-batch's loss is no part of the whole "
        "batch's and the pipeline's loss differs from one process's; give the targets the output's shape (e.g. "
        "targets.view_as(output))"
    ], ours


@pytest.mark.parametrize(
    "out_shape,target_shape",
    [((4, 1), (4, 1)), ((4, 3), (3,)), ((4, 3), (4, 3)), ((4, 1), (1, 5))],
    ids=["same", "per-feature", "equal", "per-column"],
)
def test_targets_of_the_output_s_shape_or_a_broadcast_within_it_are_not_warned_of(
    out_shape: tuple[int, ...], target_shape: tuple[int, ...]
) -> None:
    compute = Compute({1: lambda x: x}, F.mse_loss, last=1)
    run = SimpleNamespace(record=SimpleNamespace(targets=[torch.randn(target_shape)], losses={}), per_minibatch=1)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        compute.loss(run, torch.randn(out_shape, requires_grad=True), 0)  # type: ignore[arg-type]
    assert not [w for w in seen if str(w.message).startswith("stage 1:")]  # (torch's own may warn of the shapes)


def test_inputs_of_another_dtype_than_stage_0_s_parameters_name_both_and_the_fix() -> None:
    stage = torch.nn.Linear(3, 2)  # float32
    compute = Compute({0: stage, 1: lambda x: x}, F.mse_loss, last=1)
    run = SimpleNamespace(record=SimpleNamespace(inputs=[torch.randn(4, 3, dtype=torch.float64)]), mode="train")
    run.ready = lambda: None
    action = SimpleNamespace(stage=0, microbatch=0)
    with pytest.raises(RuntimeError) as err:
        compute.forward(run, action)  # type: ignore[arg-type]
    said = str(err.value)
    assert said.startswith(
        "stage 0's inputs are torch.float64 but its parameters torch.float32: convert the inputs "
        "(x.to(torch.float32)), or build the layers in torch.float64"
    ), said
    assert isinstance(err.value.__cause__, RuntimeError)  # torch's own error, kept


def test_a_batch_on_the_meta_device_is_refused_saying_it_has_no_data() -> None:
    from stagewise.runtime.engine.batches import to_device

    with pytest.raises(ValueError, match=r"a batch holds a tensor on the meta device \(shape \(4, 3\)\)"):
        to_device({"x": torch.empty(4, 3, device="meta")}, torch.device("cpu"))
