"""``from_hf`` in one process: layouts recognised or refused by name, the stage pieces chained equal the model,
the causal-LM loss and its token weights (issue 15). The multi-process parity is tests/test_hf_ranks.py."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")
import transformers as tf  # noqa: E402

import stagewise as sw  # noqa: E402
from stagewise.runtime.engine.step import prepare_step  # noqa: E402
from stagewise.runtime.frontends.hf import HFStage, recognise  # noqa: E402

V = 40
SMALL = dict(vocab_size=V, hidden_size=16, intermediate_size=24, num_attention_heads=2, num_key_value_heads=1)
SMALL.update(max_position_embeddings=32)


def tiny(family: str, layers: int = 3) -> torch.nn.Module:
    configs = {
        "gpt2": lambda: tf.GPT2Config(
            vocab_size=V, n_positions=32, n_embd=16, n_layer=layers, n_head=2, bos_token_id=0, eos_token_id=0
        ),
        "llama": lambda: tf.LlamaConfig(**SMALL, num_hidden_layers=layers),
        "mistral": lambda: tf.MistralConfig(**SMALL, num_hidden_layers=layers, sliding_window=3),
        "qwen2": lambda: tf.Qwen2Config(**SMALL, num_hidden_layers=layers),
        "qwen3": lambda: tf.Qwen3Config(**SMALL, num_hidden_layers=layers, head_dim=8),
    }
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(configs[family](), dtype=torch.float64).eval()


@pytest.mark.parametrize("family", ["gpt2", "llama", "mistral", "qwen2", "qwen3"])
def test_pieces_chained_equal_the_model(family: str) -> None:
    """Embedding + layers | layers | layers + head, chained by hand, give the model's logits on a batch padded on
    the right and on the left."""
    model = tiny(family, layers=3)
    layout = recognise(model)
    assert layout.family == ("gpt2" if family == "gpt2" else "llama")
    pieces = [HFStage(model, layout, [0], True, False), HFStage(model, layout, [1], False, False)]
    pieces.append(HFStage(model, layout, [2], False, True))
    ids = torch.randint(1, V, (3, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[1, 4:] = 0
    mask[2, 2:] = 0
    mask[0, :2] = 0  # left padding: its first query rows see no key at all
    x: tuple = (ids, mask)
    for piece in pieces:
        x = piece(*x) if isinstance(x, tuple) else piece(x)
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(x, expected, rtol=1e-12, atol=1e-12)
    names = {name for piece in pieces for _, name in piece.names}
    assert names <= {n for n, _ in model.named_modules()}, names


def test_encoder_decoder_refused() -> None:
    config = tf.T5Config(vocab_size=V, d_model=16, d_kv=8, d_ff=24, num_layers=1, num_heads=2)
    model = tf.T5ForConditionalGeneration(config)
    with pytest.raises(ValueError, match="encoder-decoder model"):
        recognise(model)


def test_unknown_layout_names_what_it_looked_for() -> None:
    config = tf.GPTNeoXConfig(vocab_size=V, hidden_size=16, num_hidden_layers=1, num_attention_heads=2)
    config.intermediate_size = 24
    model = tf.GPTNeoXForCausalLM(config)
    with pytest.raises(ValueError, match=r"model\.embed_tokens.*transformer\.wte|transformer\.wte.*model\.embed"):
        recognise(model)
    with pytest.raises(ValueError, match="gpt_neox"):
        recognise(model)


def test_base_model_refused_with_a_hint() -> None:
    with pytest.raises(ValueError, match="not its base model"):
        recognise(tiny("llama", layers=1).model)


def test_same_layout_other_forward_refused() -> None:
    """Gemma has Llama's module names but scales its embedding: replaying Llama's forward would be wrong."""
    model = tf.GemmaForCausalLM(tf.GemmaConfig(**SMALL, num_hidden_layers=1, head_dim=8))
    with pytest.raises(ValueError, match="model_type 'gemma'"):
        recognise(model)


def test_not_a_model() -> None:
    with pytest.raises(TypeError, match="nn.Module"):
        recognise("gpt2")  # type: ignore[arg-type]


def test_causal_lm_loss_is_transformers_loss() -> None:
    """Against transformers' own ForCausalLMLoss (float32) and the float64 formula written out."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 6, V, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (3, 6), generator=g)
    labels[0, :3] = -100
    labels[2, 4:] = -100
    ours = sw.causal_lm_loss(logits, labels)
    theirs = ForCausalLMLoss(logits, labels, vocab_size=V)
    written = F.cross_entropy(logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1), ignore_index=-100)
    assert ours.dtype == torch.float64
    assert abs(ours.item() - written.item()) <= 1e-14
    assert abs(ours.item() - theirs.item()) <= 4 * torch.finfo(torch.float32).eps * abs(theirs.item())
    assert sw.count_tokens(labels) == int((labels[:, 1:] != -100).sum()) == 11
    nothing = torch.full_like(labels, -100)
    assert sw.causal_lm_loss(logits, nothing).item() == 0.0 and sw.count_tokens(nothing) == 0
    with pytest.raises(ValueError, match="logits .batch, seq, vocab."):
        sw.causal_lm_loss(logits[0], labels)


def _weights(targets: torch.Tensor, m: int, loss_weights=None) -> list[float]:
    step = prepare_step(
        "train", None, targets, rank=1, placement=(0, 1), num_microbatches=m, batch_dims=(0, 0),
        device=torch.device("cpu"), has_loss=True, loss_weights=loss_weights,
    )  # fmt: skip
    assert step.weights is not None
    return step.weights


def test_loss_weights_by_tokens() -> None:
    labels = torch.full((5, 4), -100)
    labels[0, 1:] = 1  # 3 tokens in micro-batch 0 (rows 0-1)
    labels[4, 2:] = 1  # 2 tokens in micro-batch 2 (row 4); micro-batch 1 (rows 2-3) has none
    assert _weights(labels, 3) == [2 / 5, 2 / 5, 1 / 5]  # the default: rows
    assert _weights(labels, 3, sw.count_tokens) == [3 / 5, 0.0, 2 / 5]
    with pytest.raises(ValueError, match="counted nothing"):
        _weights(torch.full((4, 4), -100), 2, sw.count_tokens)
    with pytest.raises(ValueError, match="micro-batch 0: expected a count >= 0"):
        _weights(labels, 3, lambda y: -1)


def test_core_imports_without_transformers() -> None:
    """``import stagewise`` and the Pipeline (from_hf included) do not import transformers until a model is cut."""
    code = (
        "import sys, stagewise as sw; sw.Pipeline; import stagewise.runtime.frontends.hf; "
        "assert 'transformers' not in sys.modules, 'transformers imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
