"""Where a transformers causal LM keeps its decoder layers, and which stage owns each of its other modules.

Found the way transformers describes a model, then observed once, so that no family needs naming:

1. **The decoder-layer list**: the entry of ``config.base_model_pp_plan`` that is an ``nn.ModuleList`` (the
   plan transformers writes for pipelining: embedding, layers, final norm, in order); without a plan, the one
   ``nn.ModuleList`` of ``config.num_hidden_layers`` modules in the model.
2. **The embedding and the LM head**: ``get_input_embeddings()`` and ``get_output_embeddings()``.
3. **Everything else, by one probe**: the model's own forward on two zero token embeddings with every decoder
   layer skipped (a few small operations, no layer runs). The modules beside the path to the layer list that
   run *before* the layers (positions, ALiBi's embedding norm, the rotary embedding) belong to the first stage
   and are kept on every rank, since every stage runs that part of the forward again to rebuild what its own
   layers take; those that run *after* (final norm, output projections, the head) belong to the last stage.
   The probe also sees whether the forward passes a layer's output on as it is or takes ``output[0]``
   (layers that return tuples: Falcon, Bloom, GPT-J, OPT).

Refused, naming what was found: encoder-decoders, cross-attention, a model without an LM head (a base model,
with the causal LM to use instead), heads beside the LM head (``GPT2DoubleHeadsModel``: never trained
otherwise), a router loss in the model's own loss (MoE with ``output_router_logits``), transformers'
gradient checkpointing (use ``recompute=``).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class Layout:
    """A causal LM's decoder layers and who owns the rest (module names in the ``...ForCausalLM`` model)."""

    family: str  # config.model_type
    kind: str  # the model's class name
    layers: str  # the decoder-layer list
    embed: str  # the input embedding
    head: str  # the LM head
    first: tuple[str, ...]  # modules the first stage owns (embedding, what runs before the layers)
    last: tuple[str, ...]  # modules the last stage owns (what runs after the layers, the head)
    shared: tuple[str, ...]  # modules every stage's forward runs (kept on every rank, owned by the first)
    tuple_layers: bool  # the forward takes output[0] of each layer
    takes_positions: bool  # the forward has a position_ids argument (Bloom's has none: ALiBi)
    embed_dim: int  # the width of inputs_embeds


def recognise(model: nn.Module) -> Layout:
    """The layout of ``model``, or a ValueError (TypeError for a non-module) saying what was found and needed."""
    config = _config_of(model)
    kind = type(model).__name__
    _refuse_head_less(model, kind)
    layers = _layer_list(model, config, kind)
    hf: Any = model  # (transformers' own methods)
    embed, head = _name_of(model, hf.get_input_embeddings()), _name_of(model, hf.get_output_embeddings())
    base = hf.base_model
    extra = [n for n, m in model.named_children() if m is not base and n != head and _has_params(m)]
    if extra:
        raise ValueError(
            f"from_hf trains a causal LM's logits; {kind} has modules beside its base model and LM head ({extra}) "
            "that the pipeline would never train nor save: use the plain causal LM (AutoModelForCausalLM)"
        )
    _refuse_unsupported(model, config, kind)
    before, after, boxed = _probe(model, layers, embed)
    around = [n for n in _siblings(model, layers) if n not in (embed, head)]
    first = [embed] + [n for n in around if n not in after]
    last = [n for n in around if n in after] + [head]
    _refuse_shared(model, kind, first, last, embed)
    return Layout(
        family=str(getattr(config, "model_type", "?")),
        kind=kind,
        layers=layers,
        embed=embed,
        head=head,
        first=tuple(first),
        last=tuple(last),
        shared=tuple(n for n in before if n not in (embed, head)),
        tuple_layers=boxed,
        takes_positions="position_ids" in inspect.signature(hf.forward).parameters,
        embed_dim=int(hf.get_input_embeddings().embedding_dim),
    )


def _refuse_shared(model: nn.Module, kind: str, first: list[str], last: list[str], embed: str) -> None:
    """A parameter used before and after the layers, other than a tied embedding, would be trained on one side."""
    tied = {id(p) for p in model.get_submodule(embed).parameters()}
    owners = {id(p): n for n in first for p in model.get_submodule(n).parameters()}
    both = sorted({f"{owners[id(p)]} / {n}" for n in last for p in model.get_submodule(n).parameters()
                   if id(p) in owners and id(p) not in tied})  # fmt: skip
    if both:
        raise ValueError(
            f"{kind} uses parameters both before and after its decoder layers ({both}); from_hf ties only the "
            "input embedding and the LM head"
        )


def decoder_layers(model: nn.Module, layout: Layout) -> nn.ModuleList:
    """The model's decoder-layer list."""
    layers = model.get_submodule(layout.layers)
    assert isinstance(layers, nn.ModuleList), layout.layers
    return layers


def _config_of(model: Any) -> Any:
    if not isinstance(model, nn.Module):
        raise TypeError(f"from_hf needs a transformers model (an nn.Module), got {type(model).__name__}")
    config = getattr(model, "config", None)
    kind = type(model).__name__
    if config is None or not hasattr(model, "get_input_embeddings"):
        raise ValueError(f"from_hf needs a transformers model (a PreTrainedModel with a .config); {kind} is not one")
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(
            f"from_hf pipelines decoder-only causal LMs; {kind} is an encoder-decoder model "
            "(config.is_encoder_decoder is True)"
        )
    if getattr(config, "add_cross_attention", False):
        raise ValueError(f"from_hf pipelines decoder-only causal LMs; {kind} has cross-attention layers")
    on_meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if on_meta:
        raise ValueError(
            f"from_hf needs the whole model on every rank; {kind} has tensors on the meta device ({on_meta[:3]}...): "
            "an earlier Pipeline freed the other stages' part of it (build a fresh model, or deepcopy it first)"
        )
    return config


def _refuse_head_less(model: nn.Module, kind: str) -> None:
    """A model without an LM head: a base model (say which causal LM to build instead) or another task's model."""
    head = getattr(model, "get_output_embeddings", lambda: None)()
    if isinstance(head, nn.Module) and isinstance(getattr(head, "weight", None), torch.Tensor):
        return
    found = top_names(model)
    if getattr(model, "base_model", None) is model:
        causal = _causal_lm_class(getattr(model, "config", None))
        hint = f" ({causal})" if causal else ""
        raise ValueError(
            f"from_hf needs the causal LM with its LM head; {kind} is a base model without one (it has {found}): "
            f"build the causal LM instead, AutoModelForCausalLM.from_config / from_pretrained{hint}"
        )
    raise ValueError(
        f"from_hf trains causal LMs; {kind} has no LM head (get_output_embeddings() is None; it has {found})"
    )


def _causal_lm_class(config: Any) -> str | None:
    from transformers import AutoModelForCausalLM

    try:
        mapping: Any = AutoModelForCausalLM._model_mapping
        return str(mapping[type(config)].__name__)
    except (KeyError, AttributeError):
        return None


def _refuse_unsupported(model: nn.Module, config: Any, kind: str) -> None:
    if getattr(config, "output_router_logits", False):
        raise ValueError(
            f"{kind} adds its router's load-balancing loss to its loss (config.output_router_logits is True). "
            "transformers computes it from the expert counts summed over every layer and every token of the batch "
            "before any gradient flows; a pipeline's stages see their own layers and one micro-batch at a time, so "
            "no stage can compute its share: set model.config.output_router_logits = False to train on the "
            "language-model loss (exact), or use a per-layer load-balancing term of your own (stagewise.aux_loss)"
        )
    if getattr(model, "is_activation_checkpointing", None) or (
        not hasattr(model, "is_activation_checkpointing") and getattr(model, "is_gradient_checkpointing", False)
    ):  # (transformers 5.x renamed it, the old name warns)
        raise ValueError(
            f"{kind} has transformers' gradient checkpointing on; its recomputation re-runs a layer outside the "
            "stage's forward: turn it off and pass the Pipeline recompute= instead"
        )


def top_names(model: nn.Module) -> list[str]:
    """The module names at the first two levels (a layer list's items left out), for messages."""
    names = [n for n, _ in model.named_modules() if n and n.count(".") <= 1 and not n.split(".")[-1].isdigit()]
    return sorted(names)


def _layer_list(model: nn.Module, config: Any, kind: str) -> str:
    """The name of the decoder-layer list: the pipeline plan's ModuleList entry, else the one of the right length."""
    base: nn.Module = getattr(model, "base_model")  # noqa: B009 (an nn.Module attribute mypy cannot see)
    prefix = _name_of(model, base)
    plan = getattr(config, "base_model_pp_plan", None) or {}
    for key in plan:
        found = base.get_submodule(key) if _has_submodule(base, key) else None
        if isinstance(found, nn.ModuleList) and len(found):
            return f"{prefix}.{key}" if prefix else key
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    n = getattr(text, "num_hidden_layers", None)
    lists = [name for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) == n and n]
    lists = [a for a in lists if not any(a.startswith(b + ".") for b in lists)]
    if len(lists) == 1:
        return lists[0]
    plan_note = f"config.base_model_pp_plan names {list(plan)}" if plan else "config.base_model_pp_plan is not set"
    raise ValueError(
        f"from_hf does not find the decoder layers of {kind}: it needs one nn.ModuleList of the "
        f"config.num_hidden_layers ({n}) decoder layers ({plan_note}); found "
        f"{lists or 'none'} among the modules {top_names(model)}"
    )


def _siblings(model: nn.Module, layers: str) -> list[str]:
    """The modules beside the path from the model to its layer list (the parts around the layers)."""
    path = layers.split(".")
    out = []
    for depth in range(len(path)):
        parent = ".".join(path[:depth])
        module = model.get_submodule(parent) if parent else model
        for child, _ in module.named_children():
            if child != path[depth]:
                out.append(f"{parent}.{child}" if parent else child)
    return out


def _probe(model: nn.Module, layers: str, embed: str) -> tuple[list[str], set[str], bool]:
    """Run the forward once with every layer skipped: the sibling modules that run before the layers, those that
    run after them, and whether the forward takes ``output[0]`` of a layer.

    Layer 0 returns its input in a one-tuple; if layer 1 receives the tuple itself, the forward passes a layer's
    output on as it is; if it receives what is inside, the forward unpacks it.
    """
    decoder = model.get_submodule(layers)
    assert isinstance(decoder, nn.ModuleList)
    n = len(decoder)
    seen: list[Any] = []

    def skip(*args: Any, **kwargs: Any) -> Any:
        got = args[0] if args else kwargs.get("hidden_states")
        seen.append(got)
        first = seen[0]
        if len(seen) == 1:
            return (got,) if n > 1 else got
        return (first,) if seen[1] is first else first  # layer 1 got the tensor: the forward unpacks

    order: list[tuple[str, int]] = []
    hooks = [
        model.get_submodule(name).register_forward_pre_hook(lambda m, a, name=name: order.append((name, len(seen))))
        for name in _siblings(model, layers)
    ]
    embedding: Any = model.get_submodule(embed)
    weight = embedding.weight
    zeros = torch.zeros(1, 2, int(embedding.embedding_dim), dtype=weight.dtype, device=weight.device)
    try:
        with skipped(decoder, dict.fromkeys(range(n), skip)), torch.no_grad():
            model(inputs_embeds=zeros, use_cache=False, return_dict=True)
    finally:
        for hook in hooks:
            hook.remove()
    between = sorted({name for name, at in order if 0 < at < n})
    if between:
        raise ValueError(
            f"{type(model).__name__} runs {between} between its decoder layers; from_hf cuts only between layers "
            "whose forward passes the hidden states from one to the next"
        )
    before = list(dict.fromkeys(name for name, at in order if at == 0))
    return before, {name for name, at in order if at == n}, n > 1 and seen[1] is seen[0]


@contextmanager
def skipped(layers: nn.ModuleList, forwards: dict[int, Any]) -> Iterator[None]:
    """Layers ``k`` of ``layers`` run ``forwards[k]`` instead of their own forward inside the block (their hooks
    still run); restored after, even on an exception."""
    saved = {k: layers[k].__dict__.get("forward", _MISSING) for k in forwards}
    try:
        for k, fn in forwards.items():
            layers[k].__dict__["forward"] = fn
        yield
    finally:
        for k, old in saved.items():
            if old is _MISSING:
                layers[k].__dict__.pop("forward", None)
            else:
                layers[k].__dict__["forward"] = old


_MISSING = object()


def _name_of(model: nn.Module, target: Any) -> str:
    for name, module in model.named_modules():
        if module is target:
            return name
    raise ValueError(f"{type(model).__name__}: {type(target).__name__} is not one of its modules")


def _has_submodule(module: nn.Module, name: str) -> bool:
    try:
        module.get_submodule(name)
    except AttributeError:
        return False
    return True


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())
