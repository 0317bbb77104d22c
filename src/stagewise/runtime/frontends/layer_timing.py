"""Timing a layer list one layer at a time on one micro-batch: what ``partition="time"`` cuts by, and the
default cut of a list holding a convolution (:func:`.default_cut.timed_profile`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from ..measure.profiling import LayerProfile, measure_layers, preserved_state, with_checkpoint_cost
from .layers import LayerLike, build_layer
from .tied import Tied, TiedBuilder, TiedCall
from .ties import tied_layers

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
    measure_loss: Callable[[Any], float | None] | None = None,
) -> LayerProfile:
    """Profile a layer list on one micro-batch, one layer at a time under the calling convention.

    A :class:`~stagewise.Layer` spec is built (seeded as the pipeline would),
    measured on ``device`` and dropped before the next is built; an eager
    module is measured on ``device`` and moved back where it was. What a
    layer returns becomes the next layer's input, needing a gradient where it
    would in training.

    A :class:`~stagewise.Tied` key's module is built once and kept to its last use, each later use calling it
    (``forward_fn``) as the pipeline does: the head of a tied embedding is timed as the product it computes.
    The layers that use one parameter are recorded as ``tied`` (:func:`.ties.tied_layers`), as
    :func:`stagewise.profile` records them; a spec builds fresh parameters, so it ties nothing but through a key.

    ``measure_loss``: the bytes the loss keeps (``LayerProfile.loss_bytes``), from the last layer's output, where
    it can tell them (None: not known; ``from_hf``: :func:`.hf.profile.loss_measure`).
    """
    device = torch.device(device)
    x: Any = _to(sample_inputs, device)
    builder = TiedBuilder(named, seed, make=lambda layer, k: build_layer(layer, k, seed))
    given = {id(m) for _, layer in named for m in (layer, getattr(layer, "layer", None)) if isinstance(m, nn.Module)}
    layers, uses = [], []
    for k, (name, layer) in enumerate(named):
        module = builder.build(layer, k)
        shared = [module.target] if isinstance(module, TiedCall) and module.target not in module.children() else []
        homes = [(m, next((t.device for t in m.parameters()), device)) for m in (module, *shared)]
        for m, _ in homes:
            m.to(device)  # a spec is built on the CPU; an eager module goes back home after
        args = x if type(x) is tuple else (x,)
        (cost,) = measure_layers(
            [module], args, repeats=repeats, warmup=warmup, uses=shared, name=f"{k} ({name})"
        ).layers
        layers.append(replace(cost, name=name))
        x = _next_input(module, args)
        for m, home in homes:
            if id(m) in given:
                m.to(home)
        uses.append(module if isinstance(layer, Tied) or id(module) in given else _FRESH)
        del module, shared, homes
    loss = (measure_loss(x) if measure_loss is not None else None) or 0.0
    profile = LayerProfile(tuple(layers), str(device), repeats, warmup, tied=tied_layers(uses), loss_bytes=loss)
    return with_checkpoint_cost(profile)


#: what the finder of ties sees of a layer built from a spec (dropped once measured): no parameter of anyone's
_FRESH = nn.Module()


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


def with_loss_bytes(profile: LayerProfile, has_loss: bool) -> LayerProfile:
    """``profile`` with the bytes the loss keeps for its backward (``LayerProfile.loss_bytes``) estimated where it
    was profiled without them (``sample_inputs`` hold no targets to run the loss on): the size of the last layer's
    output, which a language model's cross-entropy keeps as its log-softmax (measured on the d 256 GPT: 263,172
    bytes kept for an output of 262,144). ``schedule="auto"``'s memory cap counts a stage's W stash against its
    activations: without the loss's bytes a vocabulary head's stash (its input and its output's gradient, 3x what
    its forward saves) made ZB-V and ZB-H1 overrun 1F1B's memory, and auto ran slower orders capped under it
    (2026-12-06: 0.937-0.966x 1F1B's step where ZB-V ran 0.855x); ``memory_caps`` left the loss out of the last
    stage's bytes. An estimate, low for a loss that upcasts half-precision logits first (``causal_lm_loss``, as
    transformers does: twice the output's bytes); ``from_hf`` measures its loss instead (``profile_layers``'s
    ``measure_loss``), as ``sw.profile(..., loss_fn=, targets=)`` does."""
    if not has_loss or profile.loss_bytes or not profile.layers:
        return profile
    return replace(profile, loss_bytes=float(profile.layers[-1].output_bytes))
