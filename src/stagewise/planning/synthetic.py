"""Synthetic profiles: a GPT-like layer list with its embedding/head asymmetry, for planning without a model.

Times come from FLOPs at an assumed throughput (forward: a block does
``24 s d^2 + 4 s^2 d`` FLOPs per sample, the head ``2 s d V``; backward twice
that, I and W alike); activation bytes per block from Korthikanti et al.,
"Reducing Activation Recomputation in Large Transformer Models" (2022),
``s d (34 + 5 a s / d)`` at 2 bytes per value; parameters at 2 bytes each.
"""

from __future__ import annotations

from ..partition import LayerCost, LayerProfile


def transformer_profile(
    blocks: int = 128,
    *,
    hidden: int = 8192,
    seq: int = 4096,
    vocab: int = 128_000,
    heads: int = 64,
    flops: float = 400e12,
) -> LayerProfile:
    """One sample's profile: ``embed``, ``block0`` .. ``block{blocks-1}``, ``head`` (bf16 sizes)."""
    if blocks < 1 or min(hidden, seq, vocab, heads) < 1 or not flops > 0:
        raise ValueError(
            f"transformer_profile: blocks, hidden, seq, vocab, heads must be >= 1 and flops > 0, got "
            f"{blocks}, {hidden}, {seq}, {vocab}, {heads}, {flops}"
        )
    d, s = hidden, seq
    block_f = (24 * s * d * d + 4 * s * s * d) / flops
    head_f = 2 * s * d * vocab / flops
    act = s * d * 34 + 5 * heads * s * s
    out = 2 * s * d
    layers = [LayerCost("embed", 1e-4, 0.0, 1e-4, 1e-4, out, 0.0, 2 * vocab * d, out)]
    layers += [
        LayerCost(f"block{k}", block_f, block_f, block_f, 2 * block_f, act, act / 3, 2 * 12 * d * d, out)
        for k in range(blocks)
    ]
    layers.append(LayerCost("head", head_f, head_f, head_f, 2 * head_f, 2 * s * vocab, out, 2 * vocab * d, 4))
    return LayerProfile(tuple(layers), "synthetic", 1, 0, batch=1)
