"""Whole pipelines on a one-rank process group: every schedule (stages handing values over locally) against the
model, recompute running a stage's forward exactly twice, and the fused backward path taken only where it may."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import stagewise as sw
from helpers import models as mdl


def _one_rank_cases() -> list[tuple[str, int]]:
    cases = []
    for name in sw.schedule_names():
        info = sw.schedule_info(name)
        if info.synchronous:  # (asynchronous ones train by train_stream: tests/*/test_async_*.py)
            cases += [(name, v) for v in (info.virtual_stages or (1, 3))]
    return cases


@pytest.mark.parametrize("name,v", _one_rank_cases())
def test_one_rank_pipeline_matches_the_model(one_rank, name: str, v: int) -> None:
    layers = mdl.lm()
    pipe = sw.Pipeline(layers, loss_fn=mdl.lm_loss, schedule=name, microbatches=3, virtual_stages=v, seed=5)
    ref = sw.build_model(layers, seed=5)
    x, y = mdl.lm_data(7, seed=0)
    loss = pipe.train_step(x, y)
    ref_loss = mdl.lm_loss(ref(x), y)
    ref_loss.backward()
    assert loss == pytest.approx(ref_loss.item(), rel=1e-12)
    ref_params = dict(ref.named_parameters())
    assert {n for n, _ in pipe.named_parameters()} == set(ref_params)
    for n, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, ref_params[n].grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(pipe.eval_step(x), ref(x), rtol=1e-10, atol=1e-12)


def test_one_rank_eager_modules_and_float32(one_rank) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 5))
    pipe = sw.Pipeline(model, loss_fn=F.cross_entropy, schedule="gpipe", microbatches=4)
    assert pipe.get_submodule("0") is model[0]  # eager modules are used as they are
    x, y = mdl.mlp_data(9, seed=1, dtype=torch.float32)
    pipe.train_step(x, y)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-5, atol=1e-6)


def test_one_rank_pipeline_is_not_called(one_rank) -> None:
    pipe = sw.Pipeline(mdl.mlp(), loss_fn=F.cross_entropy)
    with pytest.raises(TypeError, match="train_step"):
        pipe(torch.zeros(1, mdl.D))
    with pytest.raises(ValueError, match="needs the inputs"):
        pipe.train_step(None, torch.zeros(2))


class _Counted(nn.Linear):
    """A plain linear layer that counts its forwards (the fused W must not make a checkpoint re-run them)."""

    calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        type(self).calls += 1
        return super().forward(x)


class _CountedBlock(nn.Module):
    """A residual block with several weight regions (norm, two linears), counting its forwards."""

    calls = 0

    def __init__(self, d: int, dtype: torch.dtype) -> None:
        super().__init__()
        kw = {"dtype": dtype}
        self.norm, self.up, self.down = nn.LayerNorm(d, **kw), nn.Linear(d, 2 * d, **kw), nn.Linear(2 * d, d, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _Counted.calls += 1
        return x + self.down(F.gelu(self.up(self.norm(x))))


@pytest.mark.parametrize("name", ["gpipe", "zb-h1", "zb-v"])  # zb-v: two stages on the rank, the second split
@pytest.mark.parametrize("layer", [_Counted, _CountedBlock])
def test_a_recomputed_stage_runs_its_forward_twice_and_no_more(one_rank, name: str, layer: type) -> None:
    """recompute="stage": each layer's forward runs once in F and once when the backward (B, or I) unpacks the
    checkpoint: 2 x layers x micro-batches calls per step. Reading the saved inputs of a checkpointed linear
    node for the fused W re-runs the forward each time (it did: 8x slower steps), so those stages keep the
    engine's W; and W restarting the engine per weight region re-ran it once per region (a stage of GPT blocks:
    W at 7-8x its B), so a checkpointed stage does its W within I. Gradients equal the model's."""
    args = (6, 6) if layer is _Counted else (6,)
    layers = [sw.Layer(layer, *args, dtype=torch.float64) for _ in range(3)]
    pipe = sw.Pipeline(layers, loss_fn=F.mse_loss, schedule=name, microbatches=4, recompute="stage", seed=3)
    ref = sw.build_model(layers, seed=3)
    x = torch.randn(8, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    y = torch.randn(8, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    _Counted.calls = 0
    loss = pipe.train_step(x, y)
    assert _Counted.calls == 2 * 3 * 4
    ref_loss = F.mse_loss(ref(x), y)
    ref_loss.backward()
    assert loss == pytest.approx(ref_loss.item(), rel=1e-12)
    ref_params = dict(ref.named_parameters())
    for n, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, ref_params[n].grad, rtol=1e-10, atol=1e-12)


def test_b_takes_the_fused_path_only_for_large_weights_without_recompute(one_rank, monkeypatch) -> None:
    """The fused B repays its graph walk only with enough weight to save a pass over: a stage under
    FUSE_B_MIN_WEIGHTS elements in its largest weight, or a recomputed one, runs the engine's B."""
    from stagewise.runtime.engine import compute

    seen: list[bool] = []
    real = compute.backward_full

    def spy(*args, fused: bool = True):  # type: ignore[no-untyped-def]
        seen.append(fused)
        return real(*args, fused=fused)

    monkeypatch.setattr(compute, "backward_full", spy)
    n = 1 << 10  # one 1024 x 1024 weight: 2^20 elements, over the threshold; 8 x 8 is under
    assert n * n >= compute.FUSE_B_MIN_WEIGHTS > 64
    for width, recompute, expected in ((n, None, True), (8, None, False), (n, "stage", False)):
        seen.clear()
        pipe = sw.Pipeline(
            [nn.Linear(width, width)], loss_fn=F.mse_loss, schedule="gpipe", microbatches=2, recompute=recompute
        )
        pipe.train_step(torch.randn(4, width), torch.randn(4, width))
        assert seen == [expected, expected], (width, recompute, seen)


def test_where_this_process_stands_has_names_that_say_which_rank(one_rank) -> None:
    pipe = sw.Pipeline(mdl.mlp(num_layers=4), schedule="interleaved-1f1b", virtual_stages=2)
    assert (pipe.pp_rank, pipe.rank, pipe.process_rank, pipe.num_ranks) == (0, 0, 0, 1)
    assert pipe.local_stages == (0, 1)
    for name in ("pp_rank", "rank", "process_rank", "num_ranks", "local_stages"):
        assert getattr(sw.Pipeline, name).__doc__, f"Pipeline.{name} is undocumented (the API reference shows it)"


def test_a_batch_the_micro_batches_do_not_divide_trains_as_the_whole_batch(one_rank) -> None:
    """The guide's and the README's claim: 10 samples in 4 micro-batches (3, 3, 2, 2), each weighted by its
    share: the loss and gradients are the whole batch's mean, as one process computes them."""
    layers = mdl.lm()
    pipe = sw.Pipeline(layers, loss_fn=mdl.lm_loss, schedule="1f1b", microbatches=4, seed=2)
    ref = sw.build_model(layers, seed=2)
    x, y = mdl.lm_data(10, seed=1)
    loss = pipe.train_step(x, y)
    ref_loss = mdl.lm_loss(ref(x), y)
    ref_loss.backward()
    assert loss == pytest.approx(ref_loss.item(), rel=1e-12)
    ref_params = dict(ref.named_parameters())
    for n, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, ref_params[n].grad, rtol=1e-10, atol=1e-12)
