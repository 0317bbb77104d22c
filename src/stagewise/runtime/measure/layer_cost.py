"""What one layer costs, measured: its forward, backward (I, W, B) and checkpoint times, what it saves, what W holds.

One call of :func:`measure_layer` per layer of a profile (:mod:`.profiling` chooses the layers and what each
receives). The backward is timed through the runtime's own code (:mod:`stagewise.runtime.engine.backward`),
because that is what a stage runs; ``.grad`` is put back as it was. Timing uses CUDA events on a GPU and
``time.perf_counter`` elsewhere (:func:`timer`).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointError, checkpoint

from ...partition import LayerCost
from ..engine.backward import WeightWork, backward_full, backward_input, backward_weight
from ..engine.compute import fuses_b

#: ``timed(fn)``: ``fn()``'s result and the seconds it took on the device
Timer = Callable[[Callable[[], Any]], tuple[Any, float]]


def timer(device: torch.device) -> Timer:
    """A timer for ``device``: CUDA events on a GPU (the kernels' time, not the launch's), the wall clock elsewhere."""
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


def resident_storages(modules: Sequence[nn.Module]) -> set[int]:
    """The storages of ``modules``' parameters and buffers: what a layer saving them holds no activation for."""
    return {_storage_key(t) for m in modules for t in (*m.parameters(), *m.buffers())}


def measure_layer(
    name: str,
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    device: torch.device,
    repeats: int,
    warmup: int,
    shared: frozenset[int] = frozenset(),
) -> LayerCost:
    """``module(*args, **kwargs)``'s costs: the median of ``repeats`` timed steps after ``warmup`` others, and
    the bytes it saves for backward, W holds after I, it sends on and holds; every ``.grad`` put back after.
    ``shared``: the storages of the rest of the model's parameters and buffers (:func:`resident_storages`), not
    counted either: a later use of a tied module (``sw.Tied``: a GPT's head on the embedding's matrix) saves a
    parameter it does not register, which the runtime's meter leaves out as a parameter."""
    params = [p for p in module.parameters() if p.requires_grad]
    inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.requires_grad]
    resident = set(shared) | resident_storages([module])
    kept = [(p, None if p.grad is None else p.grad.detach().clone()) for p in params]
    try:
        out, saved, saved_count = _forward_counting_saved(module, args, kwargs, resident)
        saved_bytes = sum(saved.values())
        ends = {k: saved.get(k, 0) for k in ("input", "output")}
        out_bytes = _tensor_bytes(out)
        stash = _stash_after_input(grad_outputs(out), inputs, resident)
        del out
        med = _median_times(module, args, kwargs, params, inputs, timer(device), repeats, warmup)
    finally:
        for p, grad in kept:
            p.grad = grad
    return LayerCost(
        name=name,
        forward=med["f"],
        backward_input=med["i"],
        backward_weight=med["w"],
        backward=med["b"],
        activation_bytes=float(saved_bytes),
        weight_activation_bytes=float(stash),
        parameter_bytes=float(sum(p.numel() * p.element_size() for p in module.parameters())),
        output_bytes=float(out_bytes),
        saved_tensors=float(saved_count),
        checkpoint_forward=med["cf"],
        checkpoint_backward=med["cb"],
        input_saved_bytes=float(ends["input"]),
        output_saved_bytes=float(ends["output"]),
    )


def _median_times(
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    params: list[nn.Parameter],
    inputs: list[torch.Tensor],
    timed: Timer,
    repeats: int,
    warmup: int,
) -> dict[str, float]:
    """The median of each time :func:`_time_step` takes (f, i, w, b, and the checkpoint's cf, cb); the caller
    puts every ``.grad`` back."""
    samples: list[tuple[float, ...]] = []

    def forward() -> Any:
        return module(*args, **kwargs)

    def checkpointed() -> Any:  # as the runtime's recompute runs a segment (engine.recompute)
        return checkpoint(lambda *a: module(*a, **kwargs), *args, use_reentrant=False)

    fused = fuses_b(params)  # B's path, as a stage picks it
    for r in range(warmup + repeats):
        times = _time_step(timed, forward, checkpointed, inputs, bool(params), fused)
        if r >= warmup:
            samples.append(times)
    med = dict(zip(("f", "i", "w", "b", "cf", "cb"), (statistics.median(column) for column in zip(*samples))))
    if any(math.isnan(row[4]) for row in samples):  # the checkpoint refused it once: no cost to charge, nor a recompute
        med["cf"] = med["cb"] = 0.0
    return med


def _time_step(
    timed: Timer,
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
    outs = grad_outputs(out)
    if not outs:
        return tf, 0.0, 0.0, 0.0, 0.0, 0.0
    grads: list[torch.Tensor | None] = [torch.ones_like(t) for t in outs]
    (_, work), ti = timed(lambda: backward_input(outs, grads, inputs))
    _, tw = timed(lambda: backward_weight(work)) if has_weights else (None, 0.0)  # nothing to accumulate
    again = grad_outputs(forward())
    _, tb = timed(lambda: backward_full(again, grads, inputs, fused=fused))
    device = outs[0].device
    z = torch.ones(1, device=device, requires_grad=True)
    one = [torch.ones(1, device=device)]
    _, bi = timed(lambda: backward_input([z * 1.0], one, [z]))
    _, bb = timed(lambda: backward_full([z * 1.0], one, [z], fused=fused))
    try:
        kept, tcf = timed(checkpointed)
        _, tcb = timed(lambda: backward_full(grad_outputs(kept), grads, inputs, fused=fused))
    except CheckpointError:  # a layer whose re-run differs (a cache it appends to, say): recompute cannot run it
        return tf, max(0.0, ti - bi), tw, max(0.0, tb - bb), math.nan, math.nan
    return tf, max(0.0, ti - bi), tw, max(0.0, tb - bb), tcf - tf, tcb - tb - tf


def grad_outputs(out: Any) -> list[torch.Tensor]:
    """The tensors of ``out`` a backward starts from (those that need a gradient)."""
    return [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _tensor_bytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(value) if isinstance(t, torch.Tensor))


def _forward_counting_saved(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], resident: set[int]
) -> tuple[Any, dict[str, int], int]:
    """Run the forward once, adding up the bytes of each storage autograd saves (parameters excluded) - by
    where it lies: the input's, the output's, or inside - and counting the tensors it saves (parameters
    included: a checkpoint's hooks see every one)."""
    counted: dict[int, int] = {}
    calls = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal calls
        calls += 1
        key = _storage_key(t)
        if key and key not in resident and key not in counted:
            counted[key] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(*args, **kwargs)
    inputs = {_storage_key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
    outputs = {_storage_key(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor)}
    saved = {"input": 0, "output": 0, "inside": 0}
    for key, nbytes in counted.items():
        saved["input" if key in inputs else "output" if key in outputs else "inside"] += nbytes
    return out, saved, calls


def _stash_after_input(outs: list[torch.Tensor], inputs: list[torch.Tensor], resident: set[int]) -> int:
    """The bytes W holds once I has run on ``outs``' graph (the runtime's I, as a stage runs it), then W run to
    release them (its gradients land in ``.grad``, which the caller puts back)."""
    if not outs:
        return 0
    grads: list[torch.Tensor | None] = [torch.ones_like(t) for t in outs]
    _, work = backward_input(outs, grads, inputs)
    held = held_bytes(work, resident)
    backward_weight(work)
    return held


def held_bytes(work: WeightWork, resident: set[int]) -> int:
    """What a :class:`WeightWork` keeps alive from I to W, in bytes: the engine's own figure where the
    WeightWork reports one (``held_bytes()``), else :func:`reachable_bytes`."""
    reported = getattr(work, "held_bytes", None)
    if callable(reported):
        return int(reported())
    return reachable_bytes(work, resident)


def reachable_bytes(work: Any, resident: set[int]) -> int:
    """The bytes of every storage reachable from ``work`` (parameters and buffers in ``resident`` excluded), each
    once: the tensors it holds, and every tensor saved by an autograd node it keeps alive (through a gradient
    edge, or a held tensor's ``grad_fn``), with the nodes behind them.

    Independent of how the split stashes: a W that keeps the autograd graph pays for all of it, one that keeps
    each deferred layer's input and output gradient for just those.
    """
    tensors: list[torch.Tensor] = []
    nodes: list[Any] = []
    _collect(work, tensors, nodes, depth=0)
    seen: set[Any] = set()
    while nodes:
        node = nodes.pop()
        if node in seen:
            continue
        seen.add(node)
        nodes.extend(n for n, _ in node.next_functions if n is not None)
        for attr in dir(node):
            if attr.startswith("_saved_") or attr == "variable":
                try:
                    value = getattr(node, attr)
                except RuntimeError:  # a saved tensor already freed (the graph was not retained)
                    continue
                _collect(value, tensors, [], depth=0)
    counted: set[int] = set()
    total = 0
    for t in tensors:
        key = _storage_key(t)
        if key and key not in resident and key not in counted:
            counted.add(key)
            total += t.untyped_storage().nbytes()
    return total


def _collect(value: Any, tensors: list[torch.Tensor], nodes: list[Any], depth: int) -> None:
    """Tensors and autograd nodes inside ``value`` (an object's fields, a list, tuple, dict, tensor or node)."""
    if depth > 8 or value is None:
        return
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        if value.grad_fn is not None:
            nodes.append(value.grad_fn)
        return
    if hasattr(value, "next_functions"):  # an autograd node (a GradientEdge's, say)
        nodes.append(value)
        return
    if hasattr(value, "__dataclass_fields__"):
        value = [getattr(value, f) for f in value.__dataclass_fields__]
    elif hasattr(value, "__dict__") and not isinstance(value, (type, torch.nn.Module)):  # a plain object's fields
        value = list(vars(value).values())
    elif isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        for item in value:
            _collect(item, tensors, nodes, depth + 1)
