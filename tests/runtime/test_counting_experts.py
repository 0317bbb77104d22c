"""The count on the meta device runs a mixture-of-experts layer (issue 49 item 1: Mixtral and Qwen2-MoE were cut by
parameters, their routing by value having no meta shapes): every token's ``top_k`` experts, whatever the routing.

The reference is the layer itself, run for real (float64, transformers' eager experts) under torch's
``FlopCounterMode``: an expert's matrix products cost in proportion to the tokens it gets, so any routing of the
same tokens costs the same FLOPs, forward and backward, and the count must give exactly those.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from stagewise.runtime.measure.counting import count_layers
from stagewise.runtime.measure.routed_experts import is_routed_experts, uniform_routing

FAMILIES = ["mixtral", "qwen2_moe"]


def _moe_block(family: str) -> torch.nn.Module:
    pytest.importorskip("transformers")
    from helpers.hf_families import build

    return build(family, 1).model.layers[0].mlp


def _real_flops(block: torch.nn.Module, hidden: torch.Tensor) -> tuple[int, int]:
    """Forward and backward FLOPs of ``block`` run for real on ``hidden`` (the count's backward: ones as gradient)."""
    x = hidden.clone().requires_grad_(True)
    with FlopCounterMode(display=False) as forward:
        out = block(x)
    with FlopCounterMode(display=False) as backward:
        out.backward(torch.ones_like(out))
    return forward.get_total_flops(), backward.get_total_flops()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(("rows", "seq"), [(3, 8), (1, 1)])
def test_a_routed_layer_counts_the_flops_of_any_routing(family: str, rows: int, seq: int) -> None:
    """Counted on meta (no routing there) = run for real (the router's own picks); (1, 1): fewer token-expert
    pairs than experts, some experts idle."""
    block = _moe_block(family)
    hidden = torch.randn(
        rows, seq, block.experts.hidden_dim, dtype=torch.float64, generator=torch.Generator().manual_seed(3)
    )
    (counted,) = count_layers(["moe"], lambda _: block, hidden)
    forward, backward = _real_flops(block, hidden)
    assert forward > 0 and backward > forward
    assert (counted.forward_flops, counted.backward_flops) == (forward, backward)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_model_s_units_count_on_meta_and_the_experts_keep_their_own_forward(family: str) -> None:
    """``from_hf``'s units of an MoE model: each counted (the experts' FLOPs scale with ``top_k``, not with the
    experts the layer holds); the experts modules run their own forward again after the count."""
    pytest.importorskip("transformers")
    from helpers.hf_families import build, padded_batch
    from stagewise.runtime.frontends.hf.discover import recognise
    from stagewise.runtime.frontends.hf.stage import decoder_units

    model = build(family, 3)
    units = [u for _, u in decoder_units(model, recognise(model))]
    experts = [m for m in model.modules() if is_routed_experts(m)]
    assert len(experts) == 3
    (ids, mask), _ = padded_batch(3, 0)
    counted = count_layers([str(k) for k in range(len(units))], lambda k: units[k], (ids, mask))
    assert [c.forward_flops > 0 for c in counted] == [True] * len(units)
    assert all("forward" not in m.__dict__ for m in experts)
    block = model.model.layers[0].mlp
    tokens = torch.randn(8, experts[0].hidden_dim, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    _, weights, picked = block.gate(tokens)
    routed = type(block.experts).forward(block.experts, tokens, picked, weights)  # the router's own picks
    with uniform_routing(block) as found:
        assert found == 1
        dealt = block.experts(tokens, picked, weights)
    assert dealt.shape == routed.shape and not torch.allclose(dealt, routed)  # inside: the even deal
    assert torch.equal(block.experts(tokens, picked, weights), routed)  # after: its own forward again


def test_the_count_of_experts_follows_top_k_not_the_number_of_experts() -> None:
    """Twice the experts at the same ``top_k``: the same FLOPs but the router's; twice ``top_k``: the experts' FLOPs
    twice (what a parameter cut gets wrong: it weighs every expert)."""
    pytest.importorskip("transformers")
    import transformers as tf

    from helpers.hf_families import config

    def experts_flops(experts: int, top_k: int) -> float:
        cfg = config("mixtral", 1)
        cfg.num_local_experts, cfg.num_experts_per_tok = experts, top_k
        block = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float64).model.layers[0].mlp
        hidden = torch.zeros(2, 8, cfg.hidden_size, dtype=torch.float64)
        (counted,) = count_layers(["moe"], lambda _: block, hidden)
        router = 2 * 16 * cfg.hidden_size * experts  # (tokens x hidden) @ (hidden x experts)
        return counted.forward_flops - router

    assert experts_flops(8, 2) == experts_flops(4, 2)
    assert experts_flops(4, 4) == 2 * experts_flops(4, 2)
