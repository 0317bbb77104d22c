"""A small GPT written as a list of layers, the form a pipeline cuts: embeddings, blocks, final norm, head.

:func:`gpt_layers` returns the model as named :class:`stagewise.Layer` specs,
so each rank builds only the layers of its own stages, and
``stagewise.build_model(gpt_layers(cfg), seed)`` is the same model in one
process (same names, same initial weights).

The output projection is tied to the token embedding, as in GPT-2: the head
is a second use of the ``tokens`` layer (``sw.Tied``), computing the logits
with the embedding matrix (see :func:`tied_logits`), after a final layer norm
of its own. The first and the last stage each hold a copy;
stagewise sums its gradients over the two, and the state dict saves it once,
as ``tokens.weight``. The position embedding is the model's own, untied.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import stagewise as sw


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 64
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 6

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be a multiple of n_heads ({self.n_heads})")
        if min(self.vocab_size, self.seq_len, self.d_model, self.n_heads, self.n_layers) < 1:
            raise ValueError(f"every GPTConfig field must be >= 1, got {self}")


class Positions(nn.Module):
    """Adds a learned position embedding to the token embeddings."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(cfg.seq_len, cfg.d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.weight[: x.shape[1]]


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then an MLP, each with a residual."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(), nn.Linear(4 * cfg.d_model, cfg.d_model)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


def tied_logits(tokens: nn.Embedding, h: torch.Tensor) -> torch.Tensor:
    """The head: byte logits from the token embedding matrix, ``h @ tokens.weight.T / sqrt(d_model)``.

    The scale is T5's for its tied embeddings: the matrix keeps ``nn.Embedding``'s
    N(0, 1) initialisation (the scale of the position embedding added to it) and
    the logits of the normed last hidden state start at unit scale. (GPT-2
    starts both embeddings at N(0, 0.02) and scales nothing; on this data that
    learns markedly slower: 2.2 rather than 1.9 nats per byte on validation
    after the demo's 600 steps.)
    """
    return F.linear(h, tokens.weight) * tokens.embedding_dim**-0.5


def gpt_layers(cfg: GPTConfig) -> dict[str, sw.Layer]:
    """The model as named layer specs in order: ``tokens``, ``positions``, ``block0`` ... ``block{n-1}``,
    ``ln_f``, ``head`` (the tied second use of ``tokens``, with no weights of its own)."""
    layers = {
        "tokens": sw.Tied("tokens", sw.Layer(nn.Embedding, cfg.vocab_size, cfg.d_model)),
        "positions": sw.Layer(Positions, cfg),
    }
    layers.update({f"block{i}": sw.Layer(Block, cfg) for i in range(cfg.n_layers)})
    layers["ln_f"] = sw.Layer(nn.LayerNorm, cfg.d_model)
    layers["head"] = sw.Tied("tokens", forward_fn=tied_logits)
    return layers


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy (nats per byte) over every token of the (micro-)batch."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


@torch.no_grad()
def generate(
    model: nn.Module, prompt: bytes, length: int, seq_len: int, temperature: float = 0.8, seed: int = 0
) -> bytes:
    """Continue ``prompt`` by ``length`` bytes, sampling from the one-process model."""
    gen = torch.Generator().manual_seed(seed)
    idx = torch.tensor(list(prompt) or [10], dtype=torch.long)[None]
    for _ in range(length):
        logits = model(idx[:, -seq_len:])[0, -1] / max(temperature, 1e-6)
        nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)
        idx = torch.cat([idx, nxt[None]], dim=1)
    return bytes(idx[0, -length:].tolist()) if length else b""
