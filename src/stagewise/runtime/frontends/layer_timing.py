"""Timing a layer list one layer at a time on one micro-batch: what ``partition="time"`` cuts by, and the
default cut of a list holding a convolution (:func:`.default_cut.timed_profile`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from ..measure.profiling import LayerProfile, measure_layers, preserved_state, with_checkpoint_cost
from .layers import LayerLike, build_layer

#: how many times a partition profiles the layers; each keeps its fastest round
ROUNDS = 3


def profile_layers(
    named: Sequence[tuple[str, LayerLike]],
    sample_inputs: Any,
    *,
    seed: int = 0,
    device: torch.device | str = "cpu",
    repeats: int = 5,
    warmup: int = 2,
) -> LayerProfile:
    """Profile a layer list on one micro-batch, one layer at a time under the calling convention.

    A :class:`~stagewise.Layer` spec is built (seeded as the pipeline would),
    measured on ``device`` and dropped before the next is built; an eager
    module is measured on ``device`` and moved back where it was. What a
    layer returns becomes the next layer's input, needing a gradient where it
    would in training.
    """
    device = torch.device(device)
    x: Any = _to(sample_inputs, device)
    layers = []
    for k, (name, layer) in enumerate(named):
        module = build_layer(layer, k, seed)
        home = next((t.device for t in module.parameters()), device)
        module = module.to(device)  # a spec is built on the CPU; an eager module goes back home after
        args = x if type(x) is tuple else (x,)
        (cost,) = measure_layers([module], args, repeats=repeats, warmup=warmup).layers
        layers.append(replace(cost, name=name))
        x = _next_input(module, args)
        if module is layer:
            module.to(home)
        del module
    return with_checkpoint_cost(LayerProfile(layers=tuple(layers), device=str(device), repeats=repeats, warmup=warmup))


def _next_input(module: nn.Module, args: tuple[Any, ...]) -> Any:
    with preserved_state([module], args):
        out = module(*args)

    def leaf(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        return t.detach().requires_grad_(t.requires_grad and t.is_floating_point())

    return tree_map(leaf, out)


def _to(value: Any, device: torch.device) -> Any:
    return tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, value)
