"""The models the feature checks (feature_checks.py) train: float64 layer lists, each with a feature in it.

A tied embedding / head, an auxiliary loss, frozen parameters and values that need no gradient crossing a
stage, BatchNorm.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import stagewise as sw
from helpers.models import Res

D, V, CLASSES = 16, 24, 5


def tied_lm() -> list[sw.Layer]:
    """Embedding and LM head share one weight: 8 layers."""
    return [
        sw.Tied("embed", sw.Layer(nn.Embedding, V, D, dtype=torch.float64)),
        *[sw.Layer(Res) for _ in range(5)],
        sw.Layer(nn.LayerNorm, D, dtype=torch.float64),
        sw.Tied("embed", forward_fn=lambda emb, h: h @ emb.weight.T),
    ]


def lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, V), y.reshape(-1))


def lm_data(batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, V, (batch, 5), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def gelu_mlp(n: int = 8) -> list[sw.Layer]:
    layers = [sw.Layer(nn.Linear, D, D, dtype=torch.float64) if k % 2 == 0 else sw.Layer(nn.GELU) for k in range(n - 1)]
    return layers + [sw.Layer(nn.Linear, D, CLASSES, dtype=torch.float64)]


def mlp_data(batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, D, generator=g, dtype=torch.float64), torch.randint(0, CLASSES, (batch,), generator=g)


class ZLoss(nn.Module):
    """A linear layer that adds an auxiliary loss (z-loss-like: the mean square of its output)."""

    def __init__(self, name: str, coef: float) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D, dtype=torch.float64)
        self.name, self.coef = name, coef

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out = torch.tanh(self.lin(h))
        sw.aux_loss(self.coef * out.pow(2).mean(), self.name)
        return out


def aux_mlp() -> list[sw.Layer]:
    return [
        sw.Layer(nn.Linear, D, D, dtype=torch.float64),
        sw.Layer(ZLoss, "z", 0.5),
        sw.Layer(Res),
        sw.Layer(ZLoss, "balance", 0.25),
        sw.Layer(Res),
        sw.Layer(ZLoss, "z", 0.1),
        sw.Layer(Res),
        sw.Layer(nn.Linear, D, CLASSES, dtype=torch.float64),
    ]


def frozen_linear() -> nn.Module:
    lin = nn.Linear(D, D, dtype=torch.float64)
    lin.requires_grad_(False)
    return lin


class Fork(nn.Module):
    """h -> (h, a float mask that needs no grad, integer position ids)."""

    def forward(self, h: torch.Tensor) -> tuple:
        mask = (torch.arange(D, dtype=torch.float64) % 3 != 0).to(torch.float64).expand_as(h)
        ids = (h.detach()[:, 0] > 0).to(torch.int64) * 2 + (h.detach()[:, 1] > 0).to(torch.int64)
        return h, mask, ids  # per sample, so micro-batching does not change them


class Lora(nn.Module):
    """A frozen base linear plus a trainable low-rank update, fed the mask and ids of Fork."""

    def __init__(self) -> None:
        super().__init__()
        self.base = frozen_linear()
        self.a = nn.Linear(D, 2, bias=False, dtype=torch.float64)
        self.b = nn.Linear(2, D, bias=False, dtype=torch.float64)
        self.pos = nn.Embedding(4, D, dtype=torch.float64)

    def forward(self, h: torch.Tensor, mask: torch.Tensor, ids: torch.Tensor) -> tuple:
        return self.base(h) + self.b(self.a(h * mask)) + self.pos(ids), mask, ids


class Drop(nn.Module):
    def forward(self, h: torch.Tensor, mask: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return h * (1 + mask)


def frozen_model() -> list[sw.Layer]:
    """Frozen first layers (the first stage's outputs need no grad), a mask and ids crossing stages, LoRA."""
    return [
        sw.Layer(frozen_linear),
        sw.Layer(Fork),
        sw.Layer(Lora),
        sw.Layer(Lora),
        sw.Layer(Lora),
        sw.Layer(Drop),
        sw.Layer(Res),
        sw.Layer(nn.Linear, D, CLASSES, dtype=torch.float64),
    ]


def bn_model() -> list[sw.Layer]:
    return [
        sw.Layer(nn.Linear, D, D, dtype=torch.float64),
        sw.Layer(nn.BatchNorm1d, D, dtype=torch.float64),
        sw.Layer(nn.GELU),
        sw.Layer(nn.Linear, D, D, dtype=torch.float64),
        sw.Layer(nn.BatchNorm1d, D, dtype=torch.float64),
        sw.Layer(Res),
        sw.Layer(Res),
        sw.Layer(nn.Linear, D, CLASSES, dtype=torch.float64),
    ]
