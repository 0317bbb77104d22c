"""sw.profile(..., loss_fn=, targets=) measures what the loss keeps for its backward (LayerProfile.loss_bytes):
what autograd saves inside the loss, counted as the runtime's activation meter counts it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import stagewise as sw


@pytest.mark.parametrize("n", [5, 10])
def test_cross_entropy_keeps_its_log_softmax_and_the_targets(n: int) -> None:
    x, y = torch.randn(n, 4, dtype=torch.float64), torch.randint(0, 3, (n,))
    layers = [nn.Linear(4, 6).double(), nn.Tanh(), nn.Linear(6, 3).double()]
    p = sw.profile(layers, x, loss_fn=F.cross_entropy, targets=y, repeats=1, warmup=0)
    # log_softmax's n x 3 float64 result, the n int64 targets, and nll_loss's total weight (one float64)
    assert p.loss_bytes == n * 3 * 8 + n * 8 + 8


def test_mse_keeps_its_input_and_target() -> None:
    x, t = torch.randn(7, 4, dtype=torch.float64), torch.zeros(7, 3, dtype=torch.float64)
    p = sw.profile([nn.Linear(4, 3).double()], x, loss_fn=F.mse_loss, targets=t, repeats=1, warmup=0)
    assert p.loss_bytes == 2 * 7 * 3 * 8


def test_without_the_loss_nothing_is_counted_and_half_a_loss_is_refused() -> None:
    x = torch.randn(5, 4)
    assert sw.profile([nn.Linear(4, 3)], x, repeats=1, warmup=0).loss_bytes == 0.0
    with pytest.raises(ValueError, match="loss_fn and targets go together"):
        sw.profile([nn.Linear(4, 3)], x, loss_fn=F.cross_entropy, repeats=1, warmup=0)


def test_a_model_whose_output_is_not_one_tensor_is_refused_by_name() -> None:
    class Pair(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x, x

    with pytest.raises(ValueError, match="loss_fn takes the model's output, which here is a tuple"):
        sw.profile([nn.Linear(4, 3), Pair()], torch.randn(5, 4), loss_fn=F.mse_loss, targets=torch.zeros(5, 3))
