"""The issue's own model: a GPT written as a user would write it, not from the project's examples.

8 pre-norm blocks, d 256, 4 heads, sequence 64, vocabulary 512, float32 (issue 49's headline: 2 ranks of one
thread, 8 micro-batches of 2 sequences). Plain ``torch.nn`` (``F.scaled_dot_product_attention``, causal); the
embedding is one layer, each block one, the final norm and the untied head one: 10 layers.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import stagewise as sw

VOCAB, SEQ, D, HEADS, BLOCKS = 512, 64, 256, 4, 8
#: sequences per micro-batch
MICROBATCH = 2


class Embedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, D)
        self.positions = nn.Parameter(torch.randn(SEQ, D) * 0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tokens(ids) + self.positions[: ids.shape[1]]  # type: ignore[no-any-return]


class Block(nn.Module):
    """Pre-norm: x + attention(norm(x)), then x + MLP(norm(x))."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, HEADS, D // HEADS).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, D))
        return x + self.mlp(self.norm2(x))  # type: ignore[no-any-return]


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.out = nn.LayerNorm(D), nn.Linear(D, VOCAB, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))  # type: ignore[no-any-return]


def layers() -> list[Any]:
    return [sw.Layer(Embedding), *(sw.Layer(Block) for _ in range(BLOCKS)), sw.Layer(Head)]


def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def data(samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (samples, SEQ + 1), generator=torch.Generator().manual_seed(0))
    return ids[:, :-1], ids[:, 1:]
