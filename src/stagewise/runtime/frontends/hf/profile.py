"""A transformers causal LM profiled at the granularity ``from_hf`` cuts at: one unit per decoder layer.

``sw.profile(hf_model, input_ids)`` measures the units :class:`~stagewise.Pipeline.from_hf` builds its stages
from (:class:`.stage.HFStage`, one decoder layer each; the embedding and what runs before the layers with the
first, the final norm and the head with the last), chained on one micro-batch as the pipeline runs them. So a
plan of that profile (``sw.plan``) cuts decoder layers, and ``Pipeline.from_plan(plan, hf_model)`` (or
``from_hf(model, **plan.pipeline_options())``) builds it. Each unit is named after its decoder layer
(``model.layers.3``); the first and the last say what they also hold. A tied embedding and head
(``tie_word_embeddings``) make the first and the last unit one set of ``LayerProfile.tied``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from ....partition import LayerProfile
from ...engine.microbatch import input_ids_of
from ...losses import causal_lm_loss
from ...measure.checkpoint_cost import with_checkpoint_cost
from ...measure.profiling import loss_saved_bytes, samples_in, saved_by_loss, steadiest
from ..balance import profile_layers
from ..ties import tied_layers
from .discover import recognise
from .stage import HFStage, decoder_units

log = logging.getLogger(__name__)


def is_hf_model(model: Any) -> bool:
    """Whether ``model`` is a transformers model (its class from the transformers package, with a config)."""
    return (
        isinstance(model, nn.Module) and type(model).__module__.startswith("transformers.") and hasattr(model, "config")
    )


def hf_units(model: nn.Module) -> list[tuple[str, HFStage]]:
    """The units ``from_hf`` cuts among, named after their decoder layers."""
    return decoder_units(model, recognise(model), named=True)


def profile_hf(
    model: nn.Module,
    sample_inputs: Any,
    *,
    repeats: int = 5,
    warmup: int = 2,
    rounds: int = 1,
    batch: int | None = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    targets: Any = None,
) -> LayerProfile:
    """:func:`stagewise.profile` of a transformers causal LM: one cost per decoder layer (see the module).

    Without ``loss_fn`` and ``targets``, the loss's kept bytes are measured with the loss ``from_hf`` trains with
    (:func:`~stagewise.runtime.losses.causal_lm_loss`, the input ids as labels): the log-softmax of the logits,
    in float32 at least, is often the largest activation of a language model's last stage (a 128k vocabulary
    over 8k tokens: 4 GiB), and a plan that leaves it out may not fit there."""
    if loss_fn is None and targets is None:
        loss_fn, targets = causal_lm_loss, input_ids_of(sample_inputs)
    units = hf_units(model)
    if not units:
        raise ValueError(f"profile: {type(model).__name__} has no decoder layers to measure")
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    was_training = model.training
    try:
        measured = steadiest(
            lambda: profile_layers(units, sample_inputs, device=device, repeats=repeats, warmup=warmup), rounds
        )
    finally:
        model.train(was_training)
    modules = [unit for _, unit in units]
    loss = 0.0 if loss_fn is None else float(loss_saved_bytes(modules, sample_inputs, loss_fn, targets))
    inputs = sample_inputs if isinstance(sample_inputs, tuple) else (sample_inputs,)
    batch = batch or measured.batch or samples_in(inputs)
    return with_checkpoint_cost(replace(measured, batch=batch, loss_bytes=loss, tied=tied_layers(modules)))


def loss_measure(
    sample_inputs: Any, loss_fn: Callable[[Any, Any], torch.Tensor] | None
) -> Callable[[Any], float | None] | None:
    """What ``from_hf``'s profiled cuts (``schedule="auto"``, ``memory_caps``, ``partition="memory"``) measure the
    loss's kept bytes with, on the last unit's output as the profile leaves it (no second forward): ``loss_fn`` with
    the input ids as labels, as ``sw.profile`` takes them (a causal LM's labels have the ids' shape), so a loss that
    upcasts bfloat16 logits counts its float32 log-softmax. A loss that refuses the ids (its targets are something
    else) gives None: the estimate then stands (:func:`..layer_timing.with_loss_bytes`), and the log says why."""
    if loss_fn is None:
        return None
    ids = input_ids_of(sample_inputs)

    def measure(logits: Any) -> float | None:
        try:
            labels = (
                ids.to(logits.device) if isinstance(ids, torch.Tensor) and isinstance(logits, torch.Tensor) else ids
            )
            return float(saved_by_loss(logits, loss_fn, labels))
        except Exception as err:  # the user's loss on a guess at its targets: any refusal leaves the estimate
            log.info("stagewise: the loss's kept bytes estimated (loss_fn refused the input ids as labels: %s)", err)
            return None

    return measure


def profile_config(spec: str, *, seq: int = 128, batch: int = 1, seed: int = 0) -> LayerProfile:
    """``stagewise plan --hf SPEC``: a causal LM built locally from a transformers config (random weights, no
    download), profiled per decoder layer on ``batch`` rows of ``seq`` random tokens.

    ``SPEC``: a local ``config.json`` (or a folder holding one), or ``MODEL_TYPE:key=value,...`` (e.g.
    ``llama:num_hidden_layers=8,hidden_size=256,intermediate_size=688,num_attention_heads=4``), the arguments
    of transformers' config class for that model type.
    """
    import os

    import transformers as tf

    if os.path.exists(spec):
        config = tf.AutoConfig.from_pretrained(spec, local_files_only=True)
    else:
        kind, _, rest = spec.partition(":")
        config = tf.AutoConfig.for_model(kind, **_values(rest))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = tf.AutoModelForCausalLM.from_config(config)
    vocab = int(getattr(config, "vocab_size", 2))
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    seq = min(seq, int(limit)) if limit else seq
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))
    return profile_hf(model, ids, batch=batch)


def _values(text: str) -> dict[str, Any]:
    """``a=1,b=0.5,c=true,d=silu`` as keyword arguments (ints, floats, booleans, else strings)."""
    out: dict[str, Any] = {}
    for item in filter(None, text.split(",")):
        key, sep, raw = item.partition("=")
        if not sep:
            raise ValueError(f"--hf: expected key=value, got {item!r}")
        value: Any = raw
        for cast in (int, float):
            try:
                value = cast(raw)
                break
            except ValueError:
                continue
        if raw.lower() in ("true", "false"):
            value = raw.lower() == "true"
        out[key.strip()] = value
    return out
