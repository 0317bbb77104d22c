"""``stagewise.profile``: a layer list, a model's blocks, or a transformers causal LM's decoder layers.

One door for every way in: a transformers causal LM (``from_hf``'s models) is measured one decoder layer at a
time, as ``from_hf`` cuts it (:mod:`.hf.profile`); anything else as :func:`..measure.profiling.profile` says.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from ...partition import LayerProfile
from ..measure import profiling
from .hf.profile import is_hf_model, profile_hf
from .ties import tied_layers


def profile(
    layers_or_model: nn.Module | Sequence[nn.Module],
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
    attention_mask)``, one micro-batch.

    Layers that use one parameter (a :class:`~stagewise.Tied` key's uses, ``head.weight = embed.weight``, a
    transformers model's tied embedding and head) are recorded as ``LayerProfile.tied``
    (:func:`.ties.tied_layers`): ``sw.plan`` prices their gradient sum across ranks.
    """
    kw: dict[str, Any] = dict(repeats=repeats, warmup=warmup, rounds=rounds, batch=batch)
    if loss_fn is not None or targets is not None:
        kw.update(loss_fn=loss_fn, targets=targets)
    if is_hf_model(layers_or_model):
        assert isinstance(layers_or_model, nn.Module)
        return profile_hf(layers_or_model, sample_inputs, **kw)
    measured = profiling.profile(layers_or_model, sample_inputs, **kw)
    blocks = dict(profiling.measured_blocks(layers_or_model))
    return replace(measured, tied=tied_layers([blocks[name] for name in measured.names]))
