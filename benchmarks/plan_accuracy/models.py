"""The two models ``python -m benchmarks.plan_accuracy`` plans and times: the demo GPT and an uneven MLP."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import stagewise as sw

from .._examples import example

_gpt = example("gpt_model")
Block, GPTConfig, Positions = _gpt.Block, _gpt.GPTConfig, _gpt.Positions

GPT = GPTConfig(vocab_size=256, seq_len=64, d_model=64, n_heads=4, n_layers=6)


def gpt_layers() -> list[sw.Layer]:
    """The demo GPT (examples/gpt_model.py) with an untied head: the planner does not model tied weights."""
    c = GPT
    return (
        [sw.Layer(nn.Embedding, c.vocab_size, c.d_model), sw.Layer(Positions, c)]
        + [sw.Layer(Block, c) for _ in range(c.n_layers)]
        + [sw.Layer(nn.LayerNorm, c.d_model), sw.Layer(nn.Linear, c.d_model, c.vocab_size)]
    )


def gpt_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def gpt_data(batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, GPT.vocab_size, (batch, GPT.seq_len + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


WIDTHS = [64, 512, 64, 64, 1024, 64, 64, 64, 256, 64, 64, 64]


def linear_gelu(a: int, b: int) -> nn.Module:
    return nn.Sequential(nn.Linear(a, b), nn.GELU())


def mlp_layers() -> list[sw.Layer]:
    """Linear + GELU pairs whose hidden widths differ 16-fold: stage costs are uneven for any equal cut."""
    out = [sw.Layer(linear_gelu, a, b) for a, b in zip(WIDTHS, WIDTHS[1:])]
    return out + [sw.Layer(nn.Linear, WIDTHS[-1], 10)]


def mlp_data(batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, WIDTHS[0], generator=g), torch.randint(0, 10, (batch,), generator=g)


MODELS: dict[str, Any] = {
    "gpt": (gpt_layers, gpt_loss, gpt_data, 32, 2),  # layers, loss, data, global batch, profiled micro-batch
    "mlp": (mlp_layers, F.cross_entropy, mlp_data, 256, 8),
}
