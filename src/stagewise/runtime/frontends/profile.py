"""``stagewise.profile``: a layer list, a model's blocks, or a transformers causal LM's decoder layers.

One door for every way in: a transformers causal LM (``from_hf``'s models) is measured one decoder layer at a
time, as ``from_hf`` cuts it (:mod:`.hf.profile`); anything else as :func:`..measure.profiling.profile` says.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from ..._util import is_count
from ...partition import LayerProfile
from ..measure import profiling
from .hf.profile import is_hf_model, profile_hf
from .layers import Layer, Layers, named_layers
from .one_process import build_model
from .ties import tied_layers


def profile(
    layers_or_model: nn.Module | Layers,
    sample_inputs: Any,
    *,
    repeats: int = 5,
    warmup: int = 2,
    rounds: int = 1,
    batch: int | None = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    targets: Any = None,
) -> LayerProfile:
    """Measure each layer of ``layers_or_model`` on ``sample_inputs`` (one micro-batch); see
    :func:`stagewise.runtime.measure.profiling.profile` for the options.

    A transformers causal LM (what ``Pipeline.from_hf`` takes) is measured per decoder layer, the embedding
    with the first and the head with the last, as ``from_hf`` cuts it: ``sw.plan`` on that profile returns plans
    ``Pipeline.from_plan(plan, model)`` builds. ``sample_inputs``: ``input_ids`` or ``(input_ids,
    attention_mask)``, one micro-batch. Its loss's kept bytes are measured with ``from_hf``'s own loss unless
    ``loss_fn`` is given (:func:`.hf.profile.profile_hf`).

    Layers that use one parameter (a :class:`~stagewise.Tied` key's uses, ``head.weight = embed.weight``, a
    transformers model's tied embedding and head) are recorded as ``LayerProfile.tied``
    (:func:`.ties.tied_layers`): ``sw.plan`` prices their gradient sum across ranks. A layer list as a Pipeline
    takes it (``sw.Layer`` specs, a dict of them by name) is built first, as ``sw.build_model(layers)`` builds it.
    """
    layers_or_model = measurable(layers_or_model, "profile")
    kw: dict[str, Any] = dict(repeats=repeats, warmup=warmup, rounds=rounds, batch=batch)
    if loss_fn is not None or targets is not None:
        kw.update(loss_fn=loss_fn, targets=targets)
    if is_hf_model(layers_or_model):
        assert isinstance(layers_or_model, nn.Module)
        return profile_hf(layers_or_model, sample_inputs, **kw)
    measured = profiling.profile(layers_or_model, sample_inputs, **kw)
    blocks = dict(profiling.measured_blocks(layers_or_model))
    return replace(measured, tied=tied_layers([blocks[name] for name in measured.names]))


def profile_sizes(
    layers_or_model: nn.Module | Layers,
    sample_inputs: Any,
    sizes: Sequence[int],
    *,
    repeats: int = 5,
    warmup: int = 2,
    rounds: int = 3,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    targets: Any = None,
) -> dict[int, LayerProfile]:
    """:func:`profile` at each micro-batch size of ``sizes`` (the first ``b`` samples of ``sample_inputs`` and
    ``targets``): what ``sw.plan(..., profiles=)`` takes, and what prices a plan at another micro-batch.

    The sizes are measured in turns, one round of every size at a time (the order reversed each round), each
    layer at each size from its fastest round. A prediction at another micro-batch moves with the *ratio* of two
    sizes' costs; profiled one size after another, a drift or a burst of the machine lands on one size only
    (the fidelity GPT's forward at 2 samples over 4: 0.52-0.64 one size after the other, 0.54-0.58 in turns).
    """
    wanted = sorted(set(sizes))
    have = profiling.samples_in(sample_inputs if isinstance(sample_inputs, tuple) else (sample_inputs,))
    if not wanted or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in wanted):
        raise ValueError(f"profile_sizes: sizes must be ints >= 1 (samples per micro-batch), got {list(sizes)!r}")
    if have is None:
        raise ValueError("profile_sizes: sample_inputs hold no tensor with a first dimension (the samples to cut)")
    if wanted[-1] > have:
        raise ValueError(
            f"profile_sizes: sample_inputs hold {have} samples (their first dimension), fewer than the largest of "
            f"sizes {wanted}: give at least {wanted[-1]}"
        )
    if not is_count(rounds):
        raise ValueError(f"profile_sizes: rounds must be an int >= 1, got {rounds!r}")
    layers_or_model = measurable(layers_or_model, "profile_sizes")  # (specs built once, not once a turn)
    runs: dict[int, list[LayerProfile]] = {b: [] for b in wanted}
    for r in range(rounds):
        for b in wanted if r % 2 == 0 else wanted[::-1]:
            inputs, y = _first(sample_inputs, b, have), None if targets is None else _first(targets, b, have)
            runs[b].append(
                profile(layers_or_model, inputs, repeats=repeats, warmup=warmup, batch=b, loss_fn=loss_fn, targets=y)
            )
    return {b: profiling.fastest(runs[b]) for b in wanted}


def _first(value: Any, b: int, samples: int) -> Any:
    """``value`` with each tensor of ``samples`` rows cut to its first ``b`` (other tensors and values as they are)."""
    return tree_map(lambda t: t[:b] if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == samples else t, value)


def measurable(layers: nn.Module | Layers, who: str) -> nn.Module | Sequence[nn.Module]:
    """``layers`` as modules to measure: a model or a list of modules as given; layer specs (``sw.Layer``,
    ``sw.Tied``, a dict of them by name) built as a Pipeline builds them (``build_model``, seed 0); anything else
    refused as the Pipeline refuses it, by the layer's name (a dict of specs failed deep in the measurement, on a
    key's ``.parameters()``, before)."""
    if isinstance(layers, nn.Module):
        return layers
    try:
        named = named_layers(layers)
    except (TypeError, ValueError) as err:
        raise type(err)(f"{who}: {err}") from None
    if isinstance(layers, Mapping) or any(isinstance(x, Layer) for _, x in named):
        return build_model(layers, seed=0)
    return [m for _, m in named]  # type: ignore[misc]
