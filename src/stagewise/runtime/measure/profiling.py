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
  excluded, each storage once); ``weight_activation_bytes`` the part of it
  saved by operations that take a parameter (what W still needs after I);
* ``parameter_bytes`` and ``output_bytes`` (what goes to the next stage);
* ``saved_tensors`` (how many tensors autograd saves, parameters included) and
  ``checkpoint_forward`` / ``checkpoint_backward``: what checkpointing the
  layer alone (as the runtime's recompute does a stage) adds to its forward,
  and to its backward beyond running the forward again. Once per profile,
  :func:`with_checkpoint_cost` fits a line through these in the saved tensors
  (:class:`~stagewise.partition.CheckpointCost`): a recomputed stage is one
  segment, and the planner charges it the line at its layers' saved tensors.

Timing uses CUDA events on a GPU and ``time.perf_counter`` elsewhere.
The backward is timed through the runtime's own code rather than
``torch.autograd.grad``, because that is what a stage runs: with ``.grad``
accumulation and the runtime's graph walk the demo GPT's layers' B sums to
29.1 ms at 16 samples where ``autograd.grad`` gave 25.0, and a planner fed the
bare gradient under-predicted every step (benchmarks/RESULTS.md). I + W is
1.04x B for the GPT's layers at 16 samples, 1.2-1.5x for smaller layers or
batches; :meth:`LayerProfile.cost_model` rescales them to sum to B. Each
parameter's ``.grad`` is put back as it was.

The split between measuring and deciding follows torchgpipe
(``balance/profile.py`` measures, ``balance/blockpartition.py`` decides):
here :func:`profile` measures and :mod:`stagewise.partition.cut` decides.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.checkpoint import CheckpointError, checkpoint

from ..._util import is_count
from ...partition import CheckpointCost, LayerCost, LayerProfile
from ..engine.backward import backward_full, backward_input, backward_weight
from ..engine.interpreter import FUSE_B_MIN_WEIGHTS


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
    """
    if not is_count(rounds):
        raise ValueError(f"profile: rounds must be an int >= 1, got {rounds!r}")
    measured = steadiest(lambda: measure_layers(layers_or_model, sample_inputs, repeats=repeats, warmup=warmup), rounds)
    return with_checkpoint_cost(measured)


def steadiest(measure: Callable[[], LayerProfile], rounds: int) -> LayerProfile:
    """``measure()`` taken ``rounds`` times; each layer's costs from its round with the least forward + backward
    (a measurement on a shared machine is only ever slowed down: the process is preempted, never sped up)."""
    runs = [measure() for _ in range(rounds)]
    best = [min(costs, key=lambda c: c.forward + c.backward) for costs in zip(*(r.layers for r in runs))]
    return replace(runs[0], layers=tuple(best))


def measure_layers(
    layers_or_model: nn.Module | Sequence[nn.Module],
    sample_inputs: Any,
    *,
    repeats: int = 5,
    warmup: int = 2,
) -> LayerProfile:
    """:func:`profile` without the checkpoint's fitted line (which is taken once per profile, not per layer)."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"profile: need repeats >= 1 and warmup >= 0, got {repeats}, {warmup}")
    inputs = sample_inputs if isinstance(sample_inputs, tuple) else (sample_inputs,)
    if isinstance(layers_or_model, (nn.Sequential, nn.ModuleList)):
        named = [(n, m) for n, m in layers_or_model.named_children()]
    elif isinstance(layers_or_model, nn.Module):
        named = model_blocks(layers_or_model)
    else:
        named = [(str(i), m) for i, m in enumerate(layers_or_model)]
    if not named:
        raise ValueError("profile: no layers to measure")
    chain = not isinstance(layers_or_model, nn.Module) or isinstance(layers_or_model, (nn.Sequential, nn.ModuleList))
    owners = [m for _, m in named] if chain else [layers_or_model]
    with preserved_state(owners, inputs) as device:  # type: ignore[arg-type]
        if chain:
            calls = _capture_chain(named, inputs)
        else:
            calls = _capture_blocks(layers_or_model, named, inputs)  # type: ignore[arg-type]
        return _measure_all(calls, device, repeats, warmup)


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


def _measure_all(calls: list[Call], device: torch.device, repeats: int, warmup: int) -> LayerProfile:
    costs = [_measure(name, module, args, kwargs, device, repeats, warmup) for name, module, args, kwargs in calls]
    return LayerProfile(layers=tuple(costs), device=str(device), repeats=repeats, warmup=warmup)


def with_checkpoint_cost(measured: LayerProfile) -> LayerProfile:
    """``measured`` with what a checkpointed segment costs (:class:`~stagewise.partition.CheckpointCost`): the
    least-squares line, in the tensors a segment saves, through every segment timed - each layer checkpointed
    alone, and chains of 1 and 17 products (:func:`checkpoint_chains`), which pin the line where layers cluster.
    A stage is one segment: its extra is the line at the sum of its layers' saved tensors."""
    device = torch.device(measured.device)
    points = checkpoint_chains(device, repeats=max(measured.repeats, 15), warmup=max(measured.warmup, 2))
    points += [(x.saved_tensors, x.checkpoint_forward, x.checkpoint_backward) for x in measured.layers]
    fixed_f, per_f = _line([(n, f) for n, f, _ in points])
    fixed_b, per_b = _line([(n, b) for n, _, b in points])
    return replace(measured, checkpoint=CheckpointCost(fixed_f, fixed_b, per_f, per_b))


def _line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Intercept and slope of the least-squares line (the chains' two sizes make it defined), neither below zero:
    these are differences of small times, and a falling line is noise (then the mean, flat)."""
    xs, ys = [x for x, _ in points], [y for _, y in points]
    slope, intercept = statistics.linear_regression(xs, ys)
    if slope < 0:
        slope, intercept = 0.0, statistics.fmean(ys)
    return max(0.0, intercept), slope


CHAINS = (1, 17)  # products per checkpointed chain: two saved tensors each


def checkpoint_chains(device: torch.device, *, repeats: int = 15, warmup: int = 2) -> list[tuple[float, float, float]]:
    """Chains of ``k`` products ``a * w`` on tiny tensors, plain and checkpointed: per chain, its saved tensors,
    the forward's extra and the backward's extra beyond the plain backward and the forward again (medians)."""
    timed = _timer(device)
    a = torch.ones(8, device=device, requires_grad=True)
    w = torch.ones(8, device=device, requires_grad=True)
    points = []
    for k in CHAINS:

        def run(x: torch.Tensor, k: int = k) -> torch.Tensor:
            for _ in range(k):
                x = x * w
            return x

        rows = []
        for r in range(warmup + repeats):
            tf, tb = _forward_backward(timed, lambda: run(a), a)
            tcf, tcb = _forward_backward(timed, lambda: checkpoint(run, a, use_reentrant=False), a)
            if r >= warmup:
                rows.append((tcf - tf, tcb - tb - tf))
        points.append((2.0 * k, statistics.median(x for x, _ in rows), statistics.median(y for _, y in rows)))
    return points


def _forward_backward(
    timed: Callable[[Callable[[], Any]], tuple[Any, float]], forward: Callable[[], torch.Tensor], leaf: torch.Tensor
) -> tuple[float, float]:
    out, tf = timed(forward)
    _, tb = timed(lambda: backward_full([out], [torch.ones_like(out)], [leaf], fused=False))
    leaf.grad = None
    return tf, tb


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
    for name, module in named:
        calls.append((name, module, _detached(args), {}))
        out = module(*args)
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


# --- measuring one layer ------------------------------------------------------------------------


def _device_of(modules: list[nn.Module], inputs: tuple[Any, ...]) -> torch.device:
    for m in modules:
        for t in m.parameters():
            return t.device
    for t in tree_leaves(inputs):
        if isinstance(t, torch.Tensor):
            return t.device
    return torch.device("cpu")


def _timer(device: torch.device) -> Callable[[Callable[[], Any]], tuple[Any, float]]:
    if device.type == "cuda":

        def cuda_time(fn: Callable[[], Any]) -> tuple[Any, float]:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            end.synchronize()
            return out, start.elapsed_time(end) / 1000.0

        return cuda_time

    def wall_time(fn: Callable[[], Any]) -> tuple[Any, float]:
        start = time.perf_counter()
        out = fn()
        return out, time.perf_counter() - start

    return wall_time


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _tensor_bytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(value) if isinstance(t, torch.Tensor))


def _grad_outputs(out: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]


def _measure(
    name: str,
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    device: torch.device,
    repeats: int,
    warmup: int,
) -> LayerCost:
    params = [p for p in module.parameters() if p.requires_grad]
    inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.requires_grad]
    resident = {_storage_key(t) for t in module.parameters()} | {_storage_key(t) for t in module.buffers()}
    out, saved_bytes, saved_count = _forward_counting_saved(module, args, kwargs, resident)
    outs = _grad_outputs(out)
    weight_bytes = min(_weight_saved_bytes(outs, {id(p) for p in params}, resident), saved_bytes)
    out_bytes = _tensor_bytes(out)
    del out, outs
    timed = _timer(device)
    samples: list[tuple[float, ...]] = []

    def forward() -> Any:
        return module(*args, **kwargs)

    def checkpointed() -> Any:  # as the runtime's recompute runs a segment (engine.recompute)
        return checkpoint(lambda *a: module(*a, **kwargs), *args, use_reentrant=False)

    fused = sum(p.numel() for p in params if p.dim() == 2) >= FUSE_B_MIN_WEIGHTS  # B's path, as a stage picks it
    kept = [(p, None if p.grad is None else p.grad.detach().clone()) for p in params]
    try:
        for r in range(warmup + repeats):
            times = _time_step(timed, forward, checkpointed, inputs, bool(params), fused)
            if r >= warmup:
                samples.append(times)
    finally:
        for p, grad in kept:
            p.grad = grad
    med = dict(zip(("f", "i", "w", "b", "cf", "cb"), (statistics.median(column) for column in zip(*samples))))
    if any(math.isnan(row[4]) for row in samples):  # the checkpoint refused it once: no cost to charge, nor a recompute
        med["cf"] = med["cb"] = 0.0
    return LayerCost(
        name=name,
        forward=med["f"],
        backward_input=med["i"],
        backward_weight=med["w"],
        backward=med["b"],
        activation_bytes=float(saved_bytes),
        weight_activation_bytes=float(weight_bytes),
        parameter_bytes=float(sum(p.numel() * p.element_size() for p in module.parameters())),
        output_bytes=float(out_bytes),
        saved_tensors=float(saved_count),
        checkpoint_forward=med["cf"],
        checkpoint_backward=med["cb"],
    )


def _time_step(
    timed: Callable[[Callable[[], Any]], tuple[Any, float]],
    forward: Callable[[], Any],
    checkpointed: Callable[[], Any],
    inputs: list[torch.Tensor],
    has_weights: bool,
    fused: bool,
) -> tuple[float, ...]:
    """One timed forward, then the runtime's I and W on its graph; B on a second forward's graph; the forward
    checkpointed and B on its graph (their extra over the forward, and over B and the forward again).

    I and B less the same calls on a one-node graph, timed alongside: a stage makes one such call per
    micro-batch, not one per layer, and the runtime's cost per action (``Calibration.action``) holds it.
    """
    out, tf = timed(forward)
    outs = _grad_outputs(out)
    if not outs:
        return tf, 0.0, 0.0, 0.0, 0.0, 0.0
    grads: list[torch.Tensor | None] = [torch.ones_like(t) for t in outs]
    (_, work), ti = timed(lambda: backward_input(outs, grads, inputs))
    _, tw = timed(lambda: backward_weight(work)) if has_weights else (None, 0.0)  # nothing to accumulate
    again = _grad_outputs(forward())
    _, tb = timed(lambda: backward_full(again, grads, inputs, fused=fused))
    device = outs[0].device
    z = torch.ones(1, device=device, requires_grad=True)
    one = [torch.ones(1, device=device)]
    _, bi = timed(lambda: backward_input([z * 1.0], one, [z]))
    _, bb = timed(lambda: backward_full([z * 1.0], one, [z], fused=fused))
    try:
        kept, tcf = timed(checkpointed)
        _, tcb = timed(lambda: backward_full(_grad_outputs(kept), grads, inputs, fused=fused))
    except CheckpointError:  # a layer whose re-run differs (a cache it appends to, say): recompute cannot run it
        return tf, max(0.0, ti - bi), tw, max(0.0, tb - bb), math.nan, math.nan
    return tf, max(0.0, ti - bi), tw, max(0.0, tb - bb), tcf - tf, tcb - tb - tf


def _forward_counting_saved(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], resident: set[int]
) -> tuple[Any, int, int]:
    """Run the forward once, adding up the bytes of each storage autograd saves (parameters excluded), and
    counting the tensors it saves (parameters included: a checkpoint's hooks see every one)."""
    counted: set[int] = set()
    total = 0
    calls = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total, calls
        calls += 1
        key = _storage_key(t)
        if key and key not in resident and key not in counted:
            counted.add(key)
            total += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(*args, **kwargs)
    return out, total, calls


def _weight_saved_bytes(outs: list[torch.Tensor], params: set[int], resident: set[int]) -> int:
    """Bytes saved by autograd nodes that compute a parameter's gradient (e.g. a Linear's input)."""
    memo: dict[Any, bool] = {}

    def only_params(node: Any, depth: int = 0) -> bool:
        # True for a node whose inputs all come from parameters (AccumulateGrad of a parameter, or a view of one).
        if node in memo:
            return memo[node]
        if hasattr(node, "variable"):
            result = id(node.variable) in params
        elif depth > 3 or not node.next_functions:
            result = False
        else:
            nexts = [n for n, _ in node.next_functions if n is not None]
            result = bool(nexts) and all(only_params(n, depth + 1) for n in nexts)
        memo[node] = result
        return result

    seen: set[Any] = set()
    stack = [t.grad_fn for t in outs if t.grad_fn is not None]
    counted: set[int] = set()
    total = 0
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        nexts = [n for n, _ in node.next_functions if n is not None]
        stack.extend(nexts)
        if not any(only_params(n) for n in nexts):
            continue
        for attr in dir(node):
            if not attr.startswith("_saved_"):
                continue
            value = getattr(node, attr, None)
            if isinstance(value, torch.Tensor):
                key = _storage_key(value)
                if key and key not in resident and key not in counted:
                    counted.add(key)
                    total += value.untyped_storage().nbytes()
    return total
