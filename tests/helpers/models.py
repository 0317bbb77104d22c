"""Tiny models the runtime, distributed and system tests share, as ``stagewise.Layer`` specs (float64 unless told)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import stagewise as sw

D = 16  # hidden size
CLASSES = 5
VOCAB = 32
SEQ = 6


def mlp(num_layers: int = 10, dtype: torch.dtype = torch.float64) -> list[sw.Layer]:
    """Linear / GELU alternating, a LayerNorm, then a classifier head."""
    layers = []
    for k in range(num_layers - 2):
        layers.append(sw.Layer(nn.Linear, D, D, dtype=dtype) if k % 2 == 0 else sw.Layer(nn.GELU))
    return layers + [sw.Layer(nn.LayerNorm, D, dtype=dtype), sw.Layer(nn.Linear, D, CLASSES, dtype=dtype)]


def mlp_data(batch: int, seed: int, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, D, generator=g, dtype=dtype), torch.randint(0, CLASSES, (batch,), generator=g)


class Res(nn.Module):
    """A float64 residual block of width ``d``: ``h + tanh(W h + b)``."""

    def __init__(self, d: int = D) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d, dtype=torch.float64)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.lin(h))


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP, with residuals."""

    def __init__(self, d: int = D, heads: int = 2, dtype: torch.dtype = torch.float64) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d, dtype=dtype)
        self.qkv = nn.Linear(d, 3 * d, dtype=dtype)
        self.proj = nn.Linear(d, d, dtype=dtype)
        self.ln2 = nn.LayerNorm(d, dtype=dtype)
        self.fc = nn.Linear(d, 4 * d, dtype=dtype)
        self.out = nn.Linear(4 * d, d, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(att)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class Head(nn.Module):
    def __init__(self, dtype: torch.dtype = torch.float64) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(D, dtype=dtype)
        self.lm = nn.Linear(D, VOCAB, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm(self.ln(x))


def lm(blocks: int = 6, dtype: torch.dtype = torch.float64) -> list[sw.Layer]:
    """Token embedding, ``blocks`` transformer blocks, final norm + head: blocks + 2 layers."""
    return (
        [sw.Layer(nn.Embedding, VOCAB, D, dtype=dtype)]
        + [sw.Layer(Block, dtype=dtype) for _ in range(blocks)]
        + [sw.Layer(Head, dtype=dtype)]
    )


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def lm_data(batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (batch, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


# ---- layers that exchange structured values -----------------------------------
class Fork(nn.Module):
    """h -> (h, a gate, an integer mask, a string, a number): several tensors and non-tensors cross stages."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D, dtype=torch.float64)

    def forward(self, h: torch.Tensor) -> tuple:
        mask = (torch.arange(h.shape[-1]) % 3 != 0).to(torch.int64).expand_as(h)
        return self.lin(h), torch.sigmoid(h), mask, "gated", 0.5


class Join(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D, dtype=torch.float64)

    def forward(self, h: torch.Tensor, gate: torch.Tensor, mask: torch.Tensor, word: str, scale: float) -> dict:
        assert word == "gated" and scale == 0.5, (word, scale)
        return {"h": self.lin(h * gate * mask), "skip": h * scale}


class DictIn(nn.Module):
    """Takes the model's dict input: a batched tensor, a tensor batched along dim 1, and a plain float."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D, dtype=torch.float64)

    def forward(self, batch: dict) -> torch.Tensor:
        return self.lin(batch["x"] * batch["scale"] + batch["xt"].transpose(0, 1))


class DictOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, CLASSES, dtype=torch.float64)

    def forward(self, parts: dict) -> torch.Tensor:
        return self.lin(parts["h"] + parts["skip"])


def structured() -> list[sw.Layer]:
    """DictIn | Fork || Join | Linear | DictOut: the tuple crosses the first stage boundary, a dict the next."""
    return [
        sw.Layer(DictIn),
        sw.Layer(Fork),
        sw.Layer(Join),
        sw.Layer(nn.Identity),
        sw.Layer(DictOut),
    ]


def structured_data(batch: int, seed: int) -> tuple[dict, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, D, generator=g, dtype=torch.float64)
    xt = torch.randn(D, batch, generator=g, dtype=torch.float64)
    return {"x": x, "xt": xt, "scale": 2.0}, torch.randint(0, CLASSES, (batch,), generator=g)


STRUCTURED_BATCH_DIM = {"x": 0, "xt": 1, "scale": None}


class Boom(nn.Module):
    """Raises during forward when told to: a failure on one rank."""

    armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if Boom.armed:
            raise RuntimeError("Boom: a layer failed on purpose")
        return x


class CountedNorm(nn.LayerNorm):
    """A LayerNorm that counts its initialisations on a real device (a re-layout's new stages compute none)."""

    real_inits = 0

    def reset_parameters(self) -> None:
        if self.weight.device.type != "meta":
            CountedNorm.real_inits += 1
        super().reset_parameters()
