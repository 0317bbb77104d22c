"""Whole models (``nn.Module``s, not layer lists) for ``Pipeline.from_model``: float64, seeded, small.

``SkipNet`` sends several kinds of values across its cuts, ``Unbalanced`` has layers of very different costs,
``TiedNet`` ties a parameter across stages. Used by the one-process tests and the torchrun checks alike.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import stagewise as sw

IN, D, CLASSES = 6, 16, 5


class Block(nn.Module):
    def __init__(self, d: int = D) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d, dtype=torch.float64)
        self.norm = nn.LayerNorm(d, dtype=torch.float64)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.norm(self.lin(h)))


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, CLASSES, dtype=torch.float64)

    def forward(self, h: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return self.lin(h - 0.5 * skip)


class SkipNet(nn.Module):
    """An arbitrary forward over ``embed, blocks.0 .. blocks.{n-1}, head``.

    What crosses the cuts: ``h0`` (made on stage 0, used on the last: a
    residual that skips every stage in between), ``n = x.size(0)`` (an int,
    used to reshape on the last stage), the model's second input ``scale``
    (used only on the last stage) and the running activation. ``gate`` is a
    bare parameter used on the last stage; ``mask`` a non-persistent buffer.

    ``tags``: None (untagged), ``"attr"`` (``pipeline_stage`` set after
    building, block i on stage ``i * stages // n``) or ``"with"`` (built
    inside ``with sw.stage(k):``, same placement).
    """

    def __init__(self, num_blocks: int, stages: int = 1, tags: str | None = None, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        where = [i * stages // num_blocks for i in range(num_blocks)]
        with _stage(tags == "with", 0):
            self.embed = nn.Linear(IN, D, dtype=torch.float64)
        self.blocks = nn.ModuleList()
        for k in where:
            with _stage(tags == "with", k):
                self.blocks.append(Block())
        with _stage(tags == "with", stages - 1):
            self.head = Head()
        self.gate = nn.Parameter(torch.linspace(0.5, 1.5, D, dtype=torch.float64))
        self.register_buffer("mask", (torch.arange(D) % 4 != 3).to(torch.float64), persistent=False)
        if tags == "attr":
            self.embed.pipeline_stage = 0
            for blk, k in zip(self.blocks, where):
                blk.pipeline_stage = k
            self.head.pipeline_stage = stages - 1

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        h0 = torch.relu(self.embed(x))
        n = x.size(0)
        h = h0
        for blk in self.blocks:
            h = blk(h)
        h = (h * self.gate * self.mask).reshape(n, 2, D // 2).flatten(1)
        return self.head(h, h0) * scale.unsqueeze(-1)


class _stage:
    """``sw.stage(k)`` when ``on``, else nothing."""

    def __init__(self, on: bool, k: int) -> None:
        self.ctx = sw.stage(k) if on else None

    def __enter__(self) -> None:
        if self.ctx is not None:
            self.ctx.__enter__()

    def __exit__(self, *exc: Any) -> None:
        if self.ctx is not None:
            self.ctx.__exit__(*exc)


def skip_data(batch: int, seed: int) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, IN, generator=g, dtype=torch.float64)
    scale = 0.5 + torch.rand(batch, generator=g, dtype=torch.float64)
    return (x, scale), torch.randint(0, CLASSES, (batch,), generator=g)


class Dense(nn.Module):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d_in, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x))


NARROW, WIDE = 32, 384


class Unbalanced(nn.Module):
    """40 narrow layers (width 32), then 40 wide ones (384; on a CPU each costs ~8 narrow ones): a uniform cut
    by count puts nearly all the work on the last stage; a wide layer is ~5 % of a balanced stage's work."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        widths = [NARROW] * 41 + [WIDE] * 40
        self.layers = nn.ModuleList(Dense(a, b) for a, b in zip(widths, widths[1:]))
        self.head = nn.Linear(WIDE, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


# ---- tied parameters across stages ------------------------------------------------------
VOCAB = 11


class TiedNet(nn.Module):
    """A token embedding tied to the output: ``head.weight = embed.weight`` (two names of one parameter), or
    (``functional``) the last block reading ``embed.weight`` itself (one name used on two stages)."""

    def __init__(self, num_blocks: int, functional: bool) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.embed = nn.Embedding(VOCAB, D, dtype=torch.float64)
        self.blocks = nn.ModuleList(Block() for _ in range(num_blocks))
        self.functional = functional
        if not functional:
            self.head = nn.Linear(D, VOCAB, bias=False, dtype=torch.float64)
            self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for blk in self.blocks:
            h = blk(h)
        return h @ self.embed.weight.T if self.functional else self.head(h)


def token_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


class _HiddenHead(nn.Module):
    """Logits on the embedding's matrix, reached through a reference kept outside the module tree."""

    def __init__(self, embed: nn.Embedding) -> None:
        super().__init__()
        self.__dict__["embed"] = embed  # not a child: the head holds no parameter

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h @ self.embed.weight.T


class HiddenTieNet(nn.Module):
    """TiedNet's model whose head block reads ``embed.weight`` through ``self.__dict__``: a tie neither the
    model's registrations nor its traced forward show (``from_model`` refuses it at the first forward)."""

    def __init__(self, num_blocks: int) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.embed = nn.Embedding(VOCAB, D, dtype=torch.float64)
        self.blocks = nn.ModuleList(Block() for _ in range(num_blocks))
        self.head = _HiddenHead(self.embed)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for blk in self.blocks:
            h = blk(h)
        return self.head(h)
