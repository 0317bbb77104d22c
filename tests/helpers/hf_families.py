"""Tiny random-init causal LMs of every family ``Pipeline.from_hf`` is tested on, built offline from configs.

Float64, no dropout, each family with what sets it apart switched on at a size that shows: Gemma 2's logit
soft-capping, Granite's embedding / residual / logit multipliers, Cohere's logit scale, Gemma 3's sliding and
global layers with their own rotary embeddings, Falcon's ALiBi variant, OPT's projections around its layers,
Bloom's ALiBi from the mask. MoE experts run transformers' "eager" kernels (its grouped kernels take no float64).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

V, S = 48, 8  # vocabulary, sequence length
IDS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
SMALL = dict(vocab_size=V, hidden_size=16, intermediate_size=24, num_attention_heads=2, max_position_embeddings=32)
GQA = dict(SMALL, num_key_value_heads=1, **IDS)
MHA = dict(SMALL, num_key_value_heads=2, **IDS)
NO_DROPOUT = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def _alternating(layers: int) -> list[str]:
    return ["sliding_attention" if k % 2 == 0 else "full_attention" for k in range(layers)]


#: family -> (config.model_type, the config's arguments for a number of decoder layers)
FAMILIES: dict[str, tuple[str, Callable[[int], dict[str, Any]]]] = {
    "gpt2": ("gpt2", lambda n: dict(vocab_size=V, n_positions=32, n_embd=16, n_layer=n, n_head=2, **NO_DROPOUT, **IDS)),
    "gpt_neox": ("gpt_neox", lambda n: dict(SMALL, num_hidden_layers=n, rotary_pct=0.5, **IDS)),
    "opt": (
        "opt",
        lambda n: dict(
            vocab_size=V,
            hidden_size=16,
            ffn_dim=24,
            num_hidden_layers=n,
            num_attention_heads=2,
            max_position_embeddings=32,
            word_embed_proj_dim=12,
            dropout=0.0,
            **IDS,
        ),
    ),  # fmt: skip
    "phi": ("phi", lambda n: dict(MHA, num_hidden_layers=n, partial_rotary_factor=0.5)),
    "phi3": ("phi3", lambda n: dict(MHA, num_hidden_layers=n)),
    "gemma": ("gemma", lambda n: dict(GQA, num_hidden_layers=n, head_dim=8)),
    "gemma2": (
        "gemma2",
        lambda n: dict(
            GQA,
            num_hidden_layers=n,
            head_dim=8,
            sliding_window=4,
            final_logit_softcapping=0.5,
            attn_logit_softcapping=2.0,
            query_pre_attn_scalar=8,
        ),
    ),  # fmt: skip
    "gemma3": (
        "gemma3_text",
        lambda n: dict(
            GQA,
            num_hidden_layers=n,
            head_dim=8,
            sliding_window=4,
            layer_types=_alternating(n),
            final_logit_softcapping=0.5,
            query_pre_attn_scalar=8,
        ),
    ),  # fmt: skip
    "llama": ("llama", lambda n: dict(GQA, num_hidden_layers=n)),
    "mistral": ("mistral", lambda n: dict(GQA, num_hidden_layers=n, sliding_window=3)),
    "mixtral": ("mixtral", lambda n: dict(GQA, num_hidden_layers=n, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2": ("qwen2", lambda n: dict(GQA, num_hidden_layers=n)),
    "qwen2_moe": (
        "qwen2_moe",
        lambda n: dict(
            GQA,
            num_hidden_layers=n,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=8,
            shared_expert_intermediate_size=12,
        ),
    ),  # fmt: skip
    "qwen3": ("qwen3", lambda n: dict(GQA, num_hidden_layers=n, head_dim=8)),
    "falcon": (
        "falcon",
        lambda n: dict(
            vocab_size=V,
            hidden_size=16,
            num_hidden_layers=n,
            num_attention_heads=2,
            multi_query=True,
            max_position_embeddings=32,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            **IDS,
        ),
    ),  # fmt: skip
    "falcon_alibi": (
        "falcon",
        lambda n: dict(
            vocab_size=V,
            hidden_size=16,
            num_hidden_layers=n,
            num_attention_heads=2,
            alibi=True,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            **IDS,
        ),
    ),  # fmt: skip
    "bloom": (
        "bloom",
        lambda n: dict(
            vocab_size=V, hidden_size=16, n_layer=n, n_head=2, hidden_dropout=0.0, attention_dropout=0.0, **IDS
        ),
    ),  # fmt: skip
    "gptj": (
        "gptj",
        lambda n: dict(vocab_size=V, n_positions=32, n_embd=16, n_layer=n, n_head=2, rotary_dim=4, **NO_DROPOUT, **IDS),
    ),
    "stablelm": ("stablelm", lambda n: dict(MHA, num_hidden_layers=n, partial_rotary_factor=0.5)),
    "olmo": ("olmo", lambda n: dict(MHA, num_hidden_layers=n)),
    "olmo2": ("olmo2", lambda n: dict(MHA, num_hidden_layers=n)),
    "granite": (
        "granite",
        lambda n: dict(
            GQA,
            num_hidden_layers=n,
            embedding_multiplier=3.0,
            residual_multiplier=0.5,
            logits_scaling=4.0,
            attention_multiplier=0.3,
        ),
    ),  # fmt: skip
    "cohere": ("cohere", lambda n: dict(GQA, num_hidden_layers=n, logit_scale=0.5)),
    "gpt_neo": (
        "gpt_neo",
        lambda n: dict(
            vocab_size=V,
            max_position_embeddings=32,
            hidden_size=16,
            intermediate_size=24,
            num_layers=n,
            num_heads=2,
            attention_types=[[["global", "local"], n // 2], *([[["global"], 1]] if n % 2 else [])],
            window_size=4,
            resid_dropout=0.0,
            embed_dropout=0.0,
            attention_dropout=0.0,
            **IDS,
        ),
    ),  # fmt: skip
}

#: families whose norms compute in float32 inside a float64 model: their weights' gradients are float32 sums over
#: the batch's tokens, so the sum of micro-batches' differs from the whole batch's by float32 rounding
FLOAT32_NORMS = ("gemma", "gemma2", "gemma3", "cohere")

#: families whose attention runs transformers' "eager" kernel, which gives NaN rows in float64 for a query that
#: sees no key (left padding): they are tested right-padded only
EAGER = ("gemma2", "bloom")


def config(family: str, layers: int = 2, tied: bool | None = None) -> Any:
    """The family's tiny config; ``tied``: tie the head to the embedding (None: the family's default)."""
    import transformers as tf

    model_type, make = FAMILIES[family]
    kwargs = make(layers)
    if tied is not None:
        kwargs["tie_word_embeddings"] = tied
    return tf.AutoConfig.for_model(model_type, **kwargs)


def build(family: str, layers: int = 2, tied: bool | None = None, seed: int = 0) -> torch.nn.Module:
    """A random-init float64 causal LM of ``family``, the same on every rank (the global RNG left as it was)."""
    import transformers as tf

    extra = {"experts_implementation": "eager"} if family in ("mixtral", "qwen2_moe") else {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return tf.AutoModelForCausalLM.from_config(config(family, layers, tied), dtype=torch.float64, **extra)


def with_dropout(layers: int = 4, seed: int = 0) -> torch.nn.Module:
    """GPT-BigCode at its default dropouts (``resid_pdrop``, ``embd_pdrop``, ``attn_pdrop``: 0.1), in training mode:
    the issue's example of a model whose masks must be drawn alike by a pipeline and one process."""
    import transformers as tf

    config = tf.AutoConfig.for_model(
        "gpt_bigcode", vocab_size=V, n_positions=32, n_embd=16, n_layer=layers, n_head=2, **IDS
    )
    assert config.resid_pdrop == config.embd_pdrop == config.attn_pdrop == 0.1, config
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return tf.AutoModelForCausalLM.from_config(config, dtype=torch.float64).train()


def is_tied(model: torch.nn.Module) -> bool:
    return model.get_output_embeddings().weight is model.get_input_embeddings().weight


def padded_batch(
    rows: int, seed: int, left: bool = False, shortest: int = S - 3
) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``(input_ids, attention_mask)`` padded to ``S`` (right, or left), rows of ``shortest`` to ``S`` tokens, the
    first row full; labels -100 at the padding and at about a fifth of the other tokens."""
    g = torch.Generator().manual_seed(100 + seed)
    ids = torch.randint(3, V, (rows, S), generator=g)
    lengths = torch.randint(shortest, S + 1, (rows,), generator=g)
    lengths[0] = S
    mask = (torch.arange(S)[None, :] < lengths[:, None]).long()
    mask = mask.flip(1) if left else mask
    ids = ids.masked_fill(mask == 0, 0)
    labels = ids.masked_fill(mask == 0, -100)
    labels = labels.masked_fill(torch.rand(rows, S, generator=g) < 0.2, -100)
    return (ids, mask), labels


def packed_positions(rows: int, seed: int) -> torch.Tensor:
    """Position ids of rows that pack two or three documents each: they restart at 0 where a document starts."""
    g = torch.Generator().manual_seed(200 + seed)
    out = torch.empty(rows, S, dtype=torch.long)
    for r in range(rows):
        cuts = sorted(torch.randperm(S - 2, generator=g)[: 1 + r % 2].add(1).tolist())
        starts = [0, *cuts]
        for a, b in zip(starts, [*cuts, S]):
            out[r, a:b] = torch.arange(b - a)
    return out
