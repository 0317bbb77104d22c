"""Mistakes a user makes in the first hour, refused where they are made, with the fix in the message: a module or
parameter built once inside ``sw.Layer(...)`` (shared by every model built from the list), a loss class where an
instance belongs, a loss function of the wrong arity."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import stagewise as sw
from stagewise.runtime.losses import check_loss_fn


@pytest.mark.parametrize(
    ("args", "kwargs", "where"),
    [
        ((nn.Linear(16, 32), nn.Tanh()), {}, "argument 1"),
        ((), {"head": nn.Linear(4, 4)}, "argument head="),
        (([nn.Linear(4, 4)],), {}, "argument 1[0]"),
        (((4, (nn.Tanh(),)),), {}, "argument 1[1][0]"),
        ((), {"blocks": {"a": nn.ReLU()}}, "argument blocks=['a']"),
        ((nn.Parameter(torch.zeros(3)),), {}, "argument 1"),
    ],
)
def test_a_module_or_parameter_inside_a_layer_is_refused_with_the_fix(args: tuple, kwargs: dict, where: str) -> None:
    with pytest.raises(TypeError) as info:
        sw.Layer(nn.Sequential, *args, **kwargs)
    text = str(info.value)
    assert where in text, text
    assert "built once, here" in text and "sw.Layer(lambda: nn.Sequential(" in text, text


def test_the_issue_case_no_longer_shares_one_linear_between_two_models() -> None:
    """The repro of issue 42: two models from one list shared the Linear; now the list cannot be written."""
    with pytest.raises(TypeError, match="shared by every model"):
        sw.Layer(nn.Sequential, nn.Linear(4, 4))
    layers = [sw.Layer(lambda: nn.Sequential(nn.Linear(4, 4))), sw.Layer(nn.Linear, 4, 2)]
    a, b = sw.build_model(layers, seed=0), sw.build_model(layers, seed=5)
    assert a[0][0] is not b[0][0] and not torch.equal(a[0][0].weight, b[0][0].weight)


def test_plain_values_and_tensors_inside_a_layer_are_fine() -> None:
    layer = sw.Layer(nn.Embedding, 10, 4, _weight=torch.zeros(10, 4), padding_idx=None, device=torch.device("cpu"))
    assert torch.equal(layer.build(seed=0).weight, torch.zeros(10, 4))
    assert sw.Layer(nn.Linear, 4, 2, dtype=torch.float64).build(seed=0).weight.dtype == torch.float64


def test_a_built_module_as_the_factory_is_refused_naming_both_ways() -> None:
    with pytest.raises(TypeError, match=r"got the module Linear itself.*sw.Layer\(Linear, ...\)"):
        sw.Layer(nn.Linear(4, 4))


def test_a_loss_class_is_refused_naming_the_instance_to_pass() -> None:
    with pytest.raises(TypeError, match=r"loss_fn=nn.CrossEntropyLoss is the class.*nn.CrossEntropyLoss\(\)"):
        check_loss_fn(nn.CrossEntropyLoss)
    check_loss_fn(nn.CrossEntropyLoss())
    check_loss_fn(F.cross_entropy)
    check_loss_fn(None)


@pytest.mark.parametrize(
    "fn",
    [
        lambda out: out.sum(),
        lambda out, target, weight: out.sum(),
        lambda *, out, target: out.sum(),
    ],
)
def test_a_loss_of_the_wrong_arity_is_refused_saying_how_it_is_called(fn) -> None:
    with pytest.raises(TypeError, match=r"called as loss_fn\(output, target\)"):
        check_loss_fn(fn)


@pytest.mark.parametrize(
    "fn",
    [
        lambda out, target: out.sum(),
        lambda out, target, weight=None: out.sum(),
        lambda *args: args[0].sum(),
        lambda out, *rest, **kw: out.sum(),
        max,  # a builtin without a signature: given the benefit of the doubt
    ],
)
def test_a_loss_that_takes_two_arguments_is_accepted(fn) -> None:
    check_loss_fn(fn)


def test_the_pipeline_refuses_a_loss_class_at_construction() -> None:
    with pytest.raises(TypeError, match=r"nn.CrossEntropyLoss\(\)"):
        sw.Pipeline([sw.Layer(nn.Linear, 4, 2)], loss_fn=nn.CrossEntropyLoss)


def test_options_take_a_schedule_name_in_any_case_or_an_alias() -> None:
    assert sw.Options(schedule="1F1B").schedule == "1f1b"
    assert sw.Options(schedule="interleaved").schedule == "interleaved-1f1b"
    assert sw.Options(schedule="Auto").schedule == "auto"
    with pytest.raises(ValueError, match="did you mean 'zb-v'"):
        sw.Options(schedule="zbv2")


def test_a_pipeline_runs_interleaved_by_the_readme_word(one_rank) -> None:
    pipe = sw.Pipeline([sw.Layer(nn.Linear, 4, 4) for _ in range(4)], schedule="Interleaved", virtual_stages=2)
    assert pipe.schedule.name == "interleaved-1f1b"


def test_too_few_layers_for_a_v_schedule_says_it_runs_two_stages_per_rank(one_rank) -> None:
    """ "3 layers on 4 ranks" under zb-v is 8 stages; on one rank, 1 layer for zb-v's 2 stages."""
    with pytest.raises(ValueError) as err:
        sw.Pipeline([sw.Layer(nn.Linear, 4, 2)], schedule="zb-v")
    assert str(err.value).startswith(
        "2 stages need at least 2 layers, got 1: schedule 'zb-v' runs 2 stages per rank (1 rank x 2 = 2 stages)"
    ), str(err.value)
    from stagewise.partition import stages_per_rank_note

    assert stages_per_rank_note("1f1b", 4, 1) == ""
    assert "(4 ranks x 2 = 8 stages), so it needs at least 8 layers" in stages_per_rank_note("dualpipe-v", 4, 2)


def test_a_loss_that_cuts_the_gradient_path_is_refused_at_the_step(one_rank) -> None:
    """A ``loss_fn`` that detaches the output returned a loss every step and trained nothing (every gradient None,
    2026-12-06; plain torch's backward refuses it): refused naming the stage and micro-batch; a loss on frozen
    layers (no gradient anywhere to cut) is not."""
    x, y = torch.randn(4, 4, dtype=torch.float64), torch.randn(4, 4, dtype=torch.float64)
    pipe = sw.Pipeline([sw.Layer(nn.Linear, 4, 4, dtype=torch.float64)], loss_fn=lambda o, t: F.mse_loss(o.detach(), t))
    with pytest.raises(ValueError, match=r"stage 0, micro-batch 0: loss_fn's result does not depend on the model's"):
        pipe.train_step(x, y)
    frozen = sw.Pipeline([sw.Layer(nn.Linear, 4, 4, dtype=torch.float64)], loss_fn=lambda o, t: F.mse_loss(o, t))
    for p in frozen.parameters():
        p.requires_grad_(False)
    assert frozen.train_step(x, y) == pytest.approx(F.mse_loss(frozen.eval_step(x), y).item(), rel=1e-12)


def test_a_stage_of_no_layers_is_named_in_the_refusal() -> None:
    """``partition=[3, 0]`` listed the partition modes; it names the empty stage now."""
    with pytest.raises(ValueError, match=r"partition=\[3, 0\]: every stage needs at least one layer, but stage 1 "):
        sw.Options(partition=[3, 0])
    with pytest.raises(ValueError, match="partition must be 'balanced'"):
        sw.Options(partition=[3, "x"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_a_cuda_device_without_one_is_refused_by_name(one_rank) -> None:
    """``device="cuda"`` where no GPU is seen gave torch's own error from deep inside the build."""
    with pytest.raises(ValueError, match="device='cuda' on rank 0, but this process sees no CUDA device"):
        sw.Pipeline([sw.Layer(nn.Linear, 4, 4)], device="cuda")


def test_a_sample_of_the_wrong_width_names_the_layer_it_failed_at(one_rank) -> None:
    """``sw.profile`` and a profiled cut on ``sample_inputs`` of the wrong width gave torch's "mat1 and mat2 shapes
    cannot be multiplied", naming no layer (the error keeps its type: a caller catching torch's still does)."""
    layers = [nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)]
    with pytest.raises(RuntimeError, match=r"profile: layer '0' failed on the sample inputs \(shapes \[\(4, 9\)\]\)"):
        sw.profile(nn.Sequential(*layers), torch.randn(4, 9))
    with pytest.raises(RuntimeError, match=r"profile: layer '2 \(2\)' failed on its input \(shapes \[\(4, 16\)\]\)"):
        sw.Pipeline([nn.Linear(8, 16), nn.Tanh(), nn.Linear(8, 4)], partition="time", sample_inputs=torch.randn(4, 8))
