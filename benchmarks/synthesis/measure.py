"""Measure the two real profiles the suite uses, once, into ``profiles/*.json`` (the suite itself is pure).

    .venv/bin/python -m benchmarks.synthesis.measure

* ``gpt.json``: the demo GPT (``examples/gpt_model.py``) with 12 blocks, one micro-batch of 4 sequences
  of 64 bytes: ``tokens``, ``positions``, ``block0`` .. ``block11``, ``ln_f``, the tied ``head``;
* ``llama.json``: an HF ``LlamaForCausalLM`` built from a config (no weights are downloaded: 16 decoder
  layers, hidden 128, vocabulary 8192, 4 sequences of 64 tokens), measured as the units ``from_hf`` cuts
  (decoder layer 0 with the embedding, the last with the norm and the head).

Each layer's costs come from the fastest of :data:`ROUNDS` rounds (:func:`_fastest`), on this machine's CPU
with one thread.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

import stagewise as sw

from .._examples import example

HERE = Path(__file__).parent / "profiles"
ROUNDS = 5  # each layer from its fastest round (see _fastest)


def gpt_profile(rounds: int = ROUNDS, config: object = None, batch: int = 4) -> sw.LayerProfile:
    """The demo GPT's layers (12 blocks unless ``config``, a ``GPTConfig``, says), ``batch`` sequences."""
    # internal: a layer list with a tied module (the head) profiled layer by layer as a pipeline builds it;
    # sw.profile takes modules, and build_model's model holds the tied module once
    from stagewise.runtime.frontends.balance import profile_layers
    from stagewise.runtime.frontends.layers import named_layers

    gm = example("gpt_model")
    cfg = gm.GPTConfig(n_layers=12) if config is None else config
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len))
    runs = [profile_layers(named_layers(gm.gpt_layers(cfg)), x, seed=0) for _ in range(rounds)]
    return _fastest(runs)


def llama_profile() -> sw.LayerProfile:
    from transformers import LlamaConfig, LlamaForCausalLM

    # internal: the units from_hf cuts an HF model into, which no public name gives
    from stagewise.runtime.frontends.hf import HFStage, recognise

    config = LlamaConfig(
        vocab_size=8192,
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=16,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    layout = recognise(model)
    n = config.num_hidden_layers
    units = [HFStage(model, layout, [i], first=i == 0, last=i == n - 1) for i in range(n)]
    x = torch.randint(0, config.vocab_size, (4, 64))
    return _fastest([sw.profile(units, x) for _ in range(ROUNDS)])


def _fastest(runs: list[sw.LayerProfile]) -> sw.LayerProfile:
    from dataclasses import replace

    """Each layer from its round with the least work: F, I, W and B together (a burst of other work on the
    machine slows one of them, and I and W are timed apart from B)."""
    best = [
        min(costs, key=lambda c: c.forward + c.backward_input + c.backward_weight + c.backward)
        for costs in zip(*(r.layers for r in runs))
    ]
    return replace(runs[0], layers=tuple(best))


def main() -> None:
    argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0]).parse_args()  # no options: --help only
    torch.set_num_threads(1)
    HERE.mkdir(exist_ok=True)
    for name, make in (("gpt", gpt_profile), ("llama", llama_profile)):
        prof = make()
        (HERE / f"{name}.json").write_text(prof.to_json() + "\n")
        print(f"{name}: {len(prof)} layers, F+B {sum(prof.times()) * 1e3:.2f} ms per micro-batch")


if __name__ == "__main__":
    main()
