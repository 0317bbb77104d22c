"""What the GPU check's parts share: the sizes per device, the models, the rows of the table, timing."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import stagewise as sw

from .._examples import example


@dataclass(frozen=True)
class Sizes:
    """How big each part runs: the H100's sizes, or small ones that exercise the same paths on a CPU."""

    d_model: int  # (a), (b), (d): the float64 / float32 transformer
    layers: int
    seq: int
    batch: int
    microbatches: int
    gpt: dict[str, int]  # (c), (e): GPTConfig keywords (GPT-2 small on a GPU: 124 M parameters)
    gpt_batch: int
    warmup: int
    steps: int

    @staticmethod
    def of(device: torch.device) -> Sizes:
        if device.type == "cuda":
            gpt2 = {"vocab_size": 50257, "seq_len": 1024, "d_model": 768, "n_heads": 12, "n_layers": 12}
            return Sizes(256, 8, 256, 16, 4, gpt2, 16, 5, 20)
        tiny = {"vocab_size": 64, "seq_len": 16, "d_model": 32, "n_heads": 2, "n_layers": 4}
        return Sizes(32, 4, 8, 8, 4, tiny, 8, 1, 3)


@dataclass
class Row:
    """One line of the table: a part, what it checks, what was measured, the target, and whether it was met."""

    part: str
    check: str
    measured: str
    target: str = ""
    ok: bool | None = None  # None: a measurement without a pass/fail target
    detail: dict[str, Any] = field(default_factory=dict)


class Block(nn.Module):
    """A pre-norm transformer block (causal attention, MLP), with residuals."""

    def __init__(self, d: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.heads = max(1, d // 64)
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
    def __init__(self, d: int, vocab: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d, dtype=dtype)
        self.lin = nn.Linear(d, vocab, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.ln(x))


VOCAB = 512


def lm_layers(s: Sizes, dtype: torch.dtype) -> list[sw.Layer]:
    """Embedding, ``s.layers`` blocks, norm and head (untied, so every stage holds its own weights)."""
    return (
        [sw.Layer(nn.Embedding, VOCAB, s.d_model, dtype=dtype)]
        + [sw.Layer(Block, s.d_model, dtype) for _ in range(s.layers)]
        + [sw.Layer(Head, s.d_model, VOCAB, dtype)]
    )


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def lm_data(s: Sizes, step: int, device: torch.device, vocab: int = VOCAB, seq: int | None = None) -> Any:
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, vocab, (s.batch, (seq or s.seq) + 1), generator=g)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def gpt(s: Sizes) -> tuple[Any, Callable[..., Any]]:
    """The examples' GPT (GPT-2's shape: tied head) at ``s.gpt``'s size: its layer specs and loss."""
    g = example("gpt_model")
    return g.gpt_layers(g.GPTConfig(**s.gpt)), g.lm_loss


def gpt_data(s: Sizes, step: int, device: torch.device) -> Any:
    g = torch.Generator().manual_seed(2000 + step)
    tokens = torch.randint(0, s.gpt["vocab_size"], (s.gpt_batch, s.gpt["seq_len"] + 1), generator=g)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(step: Callable[[], Any], device: torch.device, warmup: int, steps: int) -> float:
    """The median seconds of ``step`` over ``steps`` runs after ``warmup`` (the device drained around each)."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        synchronize(device)
        t = time.perf_counter()
        step()
        synchronize(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def peak_bytes(device: torch.device, run: Callable[[], Any]) -> int | None:
    """The most bytes the device's allocator held during ``run`` (None off CUDA: no allocator to ask)."""
    if device.type != "cuda":
        run()
        return None
    synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    run()
    synchronize(device)
    return int(torch.cuda.max_memory_allocated(device))


def mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"
