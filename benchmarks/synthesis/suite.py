"""The suite of cost models the issue names, as pure data: each a function of the rank count p.

Stage costs are in units of one transformer block's forward (F = I = W = 1 unless said), so makespans
read as block-forwards. Every synthetic stage keeps a third of its activations for W (as
``stagewise.planning.transformer_profile`` does), so deferring a W costs memory.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from stagewise.partition import LayerCost, LayerProfile, partition_costs
from stagewise.simulation import CostModel

PROFILES = Path(__file__).parent / "profiles"
KEEP = 1 / 3


def uniform(p: int, *, latency: float = 0.0, i: float = 1.0, w: float = 1.0, keep: float | None = None) -> CostModel:
    c = CostModel.uniform(p, backward_input=i, backward_weight=w, comm_time=latency)
    return replace(c, weight_activation_bytes=(KEEP if keep is None else keep,) * p)


def embed_head(p: int) -> CostModel:
    """4p blocks, an embedding costing 2 blocks (its input needs no gradient: I = 0) and a head costing 3,
    cut by the exact partitioner on F + I + W: stages even in total, uneven in F, I and W."""
    block = LayerCost("block", 1.0, 1.0, 1.0, 2.0, 1.0, KEEP, 1.0, 1.0)  # KEEP read at the call (--keep)
    layers = [LayerCost("embed", 2.0, 0.0, 2.0, 2.0, 1.0, 0.0, 1.0, 1.0)]
    layers += [replace(block, name=f"block{k}") for k in range(4 * p)]
    layers.append(LayerCost("head", 3.0, 3.0, 3.0, 6.0, 3.0, 3.0 * KEEP, 1.0, 1.0))
    prof = LayerProfile(tuple(layers), "synthetic", 1, 0)
    part = partition_costs(prof.times(), p)
    return prof.cost_model(part)


def measured(name: str, p: int, latency_share: float = 0.1) -> CostModel:
    """A measured profile cut into p stages by time, I, W and B charged as measured; the link's latency is
    ``latency_share`` of a mean stage F. (The saved profiles predate the measured stash: their W bytes are what the
    nodes beside a parameter saved; ``python -m benchmarks.synthesis.measure`` measures them again.)"""
    prof = LayerProfile.from_json((PROFILES / f"{name}.json").read_text())
    part = partition_costs(prof.times(), p)
    base = prof.cost_model(part)
    mean_f = sum(base.forward) / p
    return replace(base, latency=latency_share * mean_f)


#: (label, cost model of p)
SUITE: list[tuple[str, Callable[[int], CostModel]]] = [
    ("uniform", uniform),
    ("embed 2x, head 3x", embed_head),
    ("I:W = 3:1", lambda p: uniform(p, i=1.5, w=0.5)),
    ("latency 10% of F", lambda p: uniform(p, latency=0.1)),
    ("latency 30% of F", lambda p: uniform(p, latency=0.3)),
    ("demo GPT, measured", lambda p: measured("gpt", p)),
    ("HF Llama, measured", lambda p: measured("llama", p)),
]


def describe(costs: CostModel) -> str:
    return json.dumps({"F": costs.forward, "I": costs.backward_input, "W": costs.backward_weight})
