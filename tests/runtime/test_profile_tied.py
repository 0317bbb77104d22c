"""``sw.profile`` records which layers use one parameter (``LayerProfile.tied``), so that ``sw.plan`` prices their
gradient sum across ranks (tests/core/test_plan_tied.py): a ``sw.Tied`` key's uses, ``head.weight = embed.weight``
and a transformers model's tied embedding and head alike, with the bytes they share, each once."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import stagewise as sw
from helpers.nets import VOCAB, D, TiedNet
from stagewise.partition import LayerProfile


def _logits(tokens: nn.Module, h: torch.Tensor) -> torch.Tensor:
    return h @ tokens.weight.t()


def test_a_tied_key_s_uses_are_one_set_with_the_module_s_bytes() -> None:
    """The head's later use registers no parameter (``sw.Tied``): it still uses the embedding's 16 x 8 float32."""
    layers = [sw.Tied("tok", nn.Embedding(16, 8)), nn.Linear(8, 8), sw.Tied("tok", forward_fn=_logits)]
    prof = sw.profile(sw.build_model(layers, seed=0), torch.randint(0, 16, (4, 5)), repeats=1, warmup=0)
    assert prof.tied == (((0, 2), 16 * 8 * 4.0),)
    assert LayerProfile.from_json(prof.to_json()).tied == prof.tied  # what sw.plan sends every rank of a job


def test_a_model_s_shared_weight_ties_its_blocks_and_untied_layers_record_none() -> None:
    """``head.weight = embed.weight``: blocks ``embed, blocks.0, blocks.1, head``, the first and the last tied."""
    prof = sw.profile(TiedNet(2, functional=False), torch.randint(0, VOCAB, (3, 4)), repeats=1, warmup=0)
    assert prof.names[0] == "embed" and prof.names[-1] == "head"
    assert prof.tied == (((0, 3), VOCAB * D * 8.0),)
    assert sw.profile([nn.Linear(4, 4), nn.Linear(4, 4)], torch.randn(2, 4), repeats=1, warmup=0).tied == ()


@pytest.mark.parametrize("tied", [True, False])
def test_a_transformers_model_s_tied_embedding_ties_its_first_and_last_unit(tied: bool) -> None:
    pytest.importorskip("transformers")
    from helpers.hf_families import V, build, padded_batch

    (ids, mask), _ = padded_batch(2, seed=0)
    prof = sw.profile(build("llama", 3, tied=tied), (ids, mask), repeats=1, warmup=0)
    assert prof.tied == ((((0, 2), V * 16 * 8.0),) if tied else ())
