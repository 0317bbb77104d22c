"""Profiling: per-layer time and memory, measured on the device each layer runs on.

For each layer (a block of the model) we measure, as the median of
``repeats`` runs after ``warmup`` runs:

* ``forward``: the forward pass with autograd recording, as in training;
* ``backward_input`` (I) and ``backward_weight`` (W): the backward split as
  the runtime splits it for zero-bubble schedules
  (:mod:`stagewise.runtime.engine.backward`: I towards the inputs only, zero
  work when no input needs a gradient, e.g. token ids; W the weight gradients
  it left, accumulated into ``.grad``);
* ``backward`` (B): the runtime's whole backward on a second forward's graph,
  accumulating into ``.grad`` as a micro-batch does, on the fused or the
  engine's path as a stage of this layer's weights would take it;
* ``activation_bytes``: what autograd saves for backward, counted with
  ``torch.autograd.graph.saved_tensors_hooks`` (parameters and buffers
  excluded, each storage once); ``weight_activation_bytes`` what W holds once
  the runtime's I has run (its stash: every storage the pending weight work
  keeps alive, parameters excluded; :func:`.layer_cost.held_bytes`), which can
  be more than the forward saved (a linear layer's output gradient is not an
  activation);
* ``parameter_bytes`` and ``output_bytes`` (what goes to the next stage);
* ``saved_tensors`` (how many tensors autograd saves, parameters included) and
  ``checkpoint_forward`` / ``checkpoint_backward``: what checkpointing the
  layer alone (as the runtime's recompute does a stage) adds to its forward,
  and to its backward beyond running the forward again. Once per profile,
  :func:`~.checkpoint_cost.with_checkpoint_cost` fits a line through these in the saved tensors
  (:class:`~stagewise.partition.CheckpointCost`): a recomputed stage is one
  segment, and the planner charges it the line at its layers' saved tensors.

This module chooses the layers and records what each receives; :mod:`.layer_cost` measures one layer,
:mod:`.checkpoint_cost` fits the checkpoint's line.

Timing uses CUDA events on a GPU and ``time.perf_counter`` elsewhere.
The backward is timed through the runtime's own code rather than
``torch.autograd.grad``, because that is what a stage runs: with ``.grad``
accumulation and the runtime's graph walk the demo GPT's layers' B sums to
29.1 ms at 16 samples where ``autograd.grad`` gave 25.0, and a planner fed the
bare gradient under-predicted every step (benchmarks/RESULTS.md). I + W is
1.04x B for the GPT's layers at 16 samples, 1.2-1.5x for smaller layers or
batches: :meth:`LayerProfile.cost_model` charges I, W and B each as measured,
so what splitting costs is seen where schedules are chosen. Each parameter's
``.grad`` is put back as it was.

The split between measuring and deciding follows torchgpipe
(``balance/profile.py`` measures, ``balance/blockpartition.py`` decides):
here :func:`profile` measures and :mod:`stagewise.partition.cut` decides.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from ..._util import is_count
from ...partition import LayerCost, LayerProfile
from .checkpoint_cost import CHAINS, checkpoint_chains, with_checkpoint_cost
from .layer_cost import measure_layer, resident_storages


def model_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """A model's top-level blocks: its children, with a child ModuleList/Sequential/ModuleDict opened one level.

    For a transformer ``embed, layers (ModuleList of 12), norm, head`` that is
    ``embed, layers.0, ..., layers.11, norm, head`` (in registration order).
    """
    blocks: list[tuple[str, nn.Module]] = []
    for name, child in model.named_children():
        if isinstance(child, (nn.ModuleList, nn.Sequential, nn.ModuleDict)):
            blocks.extend((f"{name}.{sub}", grandchild) for sub, grandchild in child.named_children())
        else:
            blocks.append((name, child))
    return blocks


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
    """Measure each layer of ``layers_or_model`` on ``sample_inputs`` (one micro-batch).

    A list of modules, an ``nn.Sequential`` or an ``nn.ModuleList`` is a chain:
    layer i+1 takes layer i's output (a tuple becomes its positional
    arguments). Any other module is profiled block by block
    (:func:`model_blocks`): one forward of the whole model records what each
    block receives, then each block is timed alone on that. Code between
    blocks is not measured. ``sample_inputs`` is one tensor or a tuple of
    positional arguments. Global RNG state and module buffers (BatchNorm
    statistics) are restored afterwards; no ``.grad`` is touched.

    ``rounds``: the whole measurement taken that many times, each layer's costs from its fastest round
    (:func:`steadiest`): on a shared machine a burst of other work slows every repeat of the layers measured
    while it lasts, which a median over one layer's back-to-back repeats does not reject.

    ``batch``: the samples in ``sample_inputs``, recorded in the profile (:attr:`LayerProfile.batch`) so that
    the planner scales its costs right; default: the first input tensor's first dimension.

    ``loss_fn`` and ``targets`` (the micro-batch's): the bytes the loss keeps for its backward are measured
    too (:attr:`LayerProfile.loss_bytes`), which the simulator and the planner put on the last stage - for a
    language model's vocabulary the log-softmax of the logits, often larger than a decoder layer's.
    """
    if not is_count(rounds):
        raise ValueError(f"profile: rounds must be an int >= 1, got {rounds!r}")
    if batch is not None and not is_count(batch):
        raise ValueError(f"profile: batch must be an int >= 1 (samples in sample_inputs), got {batch!r}")
    if (loss_fn is None) != (targets is None):
        raise ValueError("profile: loss_fn and targets go together (the loss of one micro-batch of sample_inputs)")
    measured = steadiest(lambda: measure_layers(layers_or_model, sample_inputs, repeats=repeats, warmup=warmup), rounds)
    loss = 0.0 if loss_fn is None else float(loss_saved_bytes(layers_or_model, sample_inputs, loss_fn, targets))
    return with_checkpoint_cost(replace(measured, batch=batch or measured.batch, loss_bytes=loss))


def loss_saved_bytes(
    layers_or_model: nn.Module | Sequence[nn.Module], sample_inputs: Any, loss_fn: Callable[..., Any], targets: Any
) -> int:
    """Bytes autograd saves inside ``loss_fn(output, targets)`` (each storage once; parameters excluded), the
    output being the model's on ``sample_inputs``: what the activation meter counts for the loss at run time."""
    inputs = sample_inputs if isinstance(sample_inputs, tuple) else (sample_inputs,)
    modules = [layers_or_model] if isinstance(layers_or_model, nn.Module) else list(layers_or_model)
    params = {p.untyped_storage().data_ptr() for m in modules for p in m.parameters()}
    with preserved_state(modules, inputs), torch.no_grad():
        out: Any = inputs
        for m in modules:
            out = m(*out) if isinstance(out, tuple) else m(out)
    return saved_by_loss(out, loss_fn, targets, params)


def saved_by_loss(out: Any, loss_fn: Callable[..., Any], targets: Any, excluded: Collection[int] = ()) -> int:
    """Bytes autograd saves inside ``loss_fn(out, targets)``, each storage once (``excluded``: the storages not to
    count, by data pointer: the model's parameters); ``out`` is the model's output (one tensor)."""
    if not isinstance(out, torch.Tensor):
        raise ValueError(
            f"profile: loss_fn takes the model's output, which here is a {type(out).__name__}, not one tensor: "
            "profile without loss_fn (the loss's saved bytes are then left out of the predictions)"
        )
    leaf = out.detach().requires_grad_(out.is_floating_point())
    counted: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in excluded and ptr not in counted and t.numel():
            counted.add(ptr)
            sizes.append(t.numel() * t.element_size())
        return t

    sizes: list[int] = []
    with preserved_state([], (leaf,)), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss_fn(leaf, targets)
    return sum(sizes)


def steadiest(measure: Callable[[], LayerProfile], rounds: int) -> LayerProfile:
    """``measure()`` taken ``rounds`` times, merged by :func:`fastest`."""
    return fastest([measure() for _ in range(rounds)])


def fastest(runs: Sequence[LayerProfile]) -> LayerProfile:
    """Each layer's costs from its run with the least forward + backward (a measurement on a shared machine is
    only ever slowed down: the process is preempted, never sped up); the rest as the first run has it."""
    if not runs or len({len(r.layers) for r in runs}) != 1:
        raise ValueError(f"fastest: expected runs of the same layers, got {[len(r.layers) for r in runs]} layers")
    best = [min(costs, key=lambda c: c.forward + c.backward) for costs in zip(*(r.layers for r in runs))]
    return replace(runs[0], layers=tuple(best))


def measure_layers(
    layers_or_model: nn.Module | Sequence[nn.Module],
    sample_inputs: Any,
    *,
    repeats: int = 5,
    warmup: int = 2,
    uses: Sequence[nn.Module] = (),
    name: str | None = None,
) -> LayerProfile:
    """:func:`profile` without the checkpoint's fitted line (which is taken once per profile, not per layer);
    ``name``: one module's name, where the caller measures a list one layer at a time (said in a failure).

    ``uses``: modules whose parameters the layers use without holding them (a later ``sw.Tied`` use's shared
    module, measured alone): what they save of those is a parameter, not an activation, as in a whole model."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"profile: need repeats >= 1 and warmup >= 0, got {repeats}, {warmup}")
    inputs = sample_inputs if isinstance(sample_inputs, tuple) else (sample_inputs,)
    named = measured_blocks(layers_or_model)
    if name is not None and len(named) == 1:
        named = [(name, named[0][1])]
    if not named:
        raise ValueError("profile: no layers to measure")
    chain = not isinstance(layers_or_model, nn.Module) or isinstance(layers_or_model, (nn.Sequential, nn.ModuleList))
    owners = [m for _, m in named] if chain else [layers_or_model]
    with preserved_state(owners, inputs) as device:  # type: ignore[arg-type]
        if chain:
            calls = _capture_chain(named, inputs)
        else:
            calls = _capture_blocks(layers_or_model, named, inputs)  # type: ignore[arg-type]
        return _measure_all(calls, device, repeats, warmup, uses)


def measured_blocks(layers_or_model: nn.Module | Sequence[nn.Module]) -> list[tuple[str, nn.Module]]:
    """The ``(name, module)`` layers :func:`profile` measures, by the names its profile gives them: a chain's
    children (a list's by position), else the model's :func:`model_blocks` (the profile keeps those its forward
    calls, in call order)."""
    if isinstance(layers_or_model, (nn.Sequential, nn.ModuleList)):
        return list(layers_or_model.named_children())
    if isinstance(layers_or_model, nn.Module):
        return model_blocks(layers_or_model)
    return [(str(i), m) for i, m in enumerate(layers_or_model)]


def profile_blocks(
    model: nn.Module,
    blocks: Sequence[tuple[str, nn.Module]],
    sample_inputs: Any,
    *,
    repeats: int = 5,
    warmup: int = 2,
) -> LayerProfile:
    """Like :func:`profile` on a whole model, for the given ``(name, module)`` blocks of it."""
    inputs = sample_inputs if isinstance(sample_inputs, tuple) else (sample_inputs,)
    with preserved_state([model], inputs) as device:
        measured = _measure_all(_capture_blocks(model, list(blocks), inputs), device, repeats, warmup)
    return with_checkpoint_cost(measured)


def _measure_all(
    calls: list[Call], device: torch.device, repeats: int, warmup: int, uses: Sequence[nn.Module] = ()
) -> LayerProfile:
    shared = frozenset(resident_storages([*(c[1] for c in calls), *uses]))  # a tied later use saves another's
    costs = [measure_layer(name, m, args, kwargs, device, repeats, warmup, shared) for name, m, args, kwargs in calls]
    batch = samples_in(calls[0][2:]) if calls else None
    return LayerProfile(layers=tuple(costs), device=str(device), repeats=repeats, warmup=warmup, batch=batch)


def samples_in(inputs: Any) -> int | None:
    """The batch the inputs hold: the first tensor's first dimension (None: no tensor with one)."""
    for t in tree_leaves(inputs):
        if isinstance(t, torch.Tensor) and t.dim() >= 1:
            return int(t.shape[0])
    return None


@contextmanager
def preserved_state(modules: Sequence[nn.Module], inputs: tuple[Any, ...]) -> Iterator[torch.device]:
    """Run a block that executes ``modules`` without leaving a trace: RNG and buffers are restored after.

    Yields the device the modules (or else the inputs) live on.
    """
    device = _device_of(list(modules), inputs)
    saved = [(b, b.detach().clone()) for m in modules for b in m.buffers()]
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            yield device
    finally:
        with torch.no_grad():
            for buffer, copy in saved:
                buffer.copy_(copy)


# --- capturing what each layer receives ---------------------------------------------------------

Call = tuple[str, nn.Module, tuple[Any, ...], dict[str, Any]]


def _detached(value: Any) -> Any:
    """A private copy of ``value``'s tensors that needs a gradient exactly where the original did."""

    def one(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        copy = t.detach().clone()
        return copy.requires_grad_(t.requires_grad)

    return tree_map(one, value)


def _capture_chain(named: list[tuple[str, nn.Module]], inputs: tuple[Any, ...]) -> list[Call]:
    calls: list[Call] = []
    args = inputs
    for k, (name, module) in enumerate(named):
        calls.append((name, module, _detached(args), {}))
        try:
            out = module(*args)
        except torch.OutOfMemoryError:
            raise
        except (RuntimeError, TypeError, ValueError) as err:  # (a shape mismatch: torch names no layer)
            first = "the sample inputs" if len(named) > 1 else "its input"
            given = f"the output of {named[k - 1][0]!r}" if k else first
            shapes = [tuple(t.shape) for t in tree_leaves(args) if isinstance(t, torch.Tensor)]
            said = f"profile: layer {name!r} failed on {given} (shapes {shapes}): {err}"
            raise (type(err)(said) if type(err) in (RuntimeError, TypeError, ValueError) else ValueError(said)) from err
        args = out if isinstance(out, tuple) else (out,)
    return calls


def _capture_blocks(model: nn.Module, named: list[tuple[str, nn.Module]], inputs: tuple[Any, ...]) -> list[Call]:
    seen: dict[str, Call] = {}
    order: list[str] = []

    def hook_for(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if name not in seen:
                seen[name] = (name, module, _detached(args), _detached(kwargs))
                order.append(name)

        return hook

    handles = [m.register_forward_pre_hook(hook_for(n), with_kwargs=True) for n, m in named]
    try:
        model(*inputs)
    finally:
        for h in handles:
            h.remove()
    return [seen[n] for n in order]


def _device_of(modules: list[nn.Module], inputs: tuple[Any, ...]) -> torch.device:
    for m in modules:
        for t in m.parameters():
            return t.device
    for t in tree_leaves(inputs):
        if isinstance(t, torch.Tensor):
            return t.device
    return torch.device("cpu")


__all__ = [
    "CHAINS",
    "LayerCost",
    "LayerProfile",
    "checkpoint_chains",
    "measure_layers",
    "measured_blocks",
    "model_blocks",
    "preserved_state",
    "profile",
    "profile_blocks",
    "steadiest",
    "with_checkpoint_cost",
]
