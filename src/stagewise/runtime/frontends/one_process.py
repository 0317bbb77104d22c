"""The one-process twin of a layer list: what every test and replay compares a pipeline with."""

from __future__ import annotations

from .layers import Chain, Layers, named_layers
from .tied import TiedBuilder


def build_model(layers: Layers, seed: int = 0) -> Chain:
    """The whole model in one process, equal to what a Pipeline with the same ``seed`` builds.

    Use it as the reference: ``loss_fn(build_model(layers, seed)(x), y).backward()``
    gives the gradients ``Pipeline(layers, seed=seed).train_step(x, y)`` gives,
    and ``named_parameters()`` names match. A tied module (:class:`~stagewise.Tied`) is built once,
    registered at its first use.
    """
    named = named_layers(layers)
    builder = TiedBuilder(named, seed)
    return Chain([(name, builder.build(layer, k)) for k, (name, layer) in enumerate(named)])
