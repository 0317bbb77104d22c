"""Counting a layer list's work on the ``meta`` device: FLOPs, bytes moved and operators, per layer.

What ``partition="balanced"`` (the default) cuts by (:mod:`stagewise.partition.estimate`). Nothing is
computed and nothing is timed: each layer is built on ``meta`` (a module given already built is called
with ``meta`` copies of its parameters through ``torch.func.functional_call``), one micro-batch of the
sample inputs, moved to ``meta``, goes forward and back, and a dispatch mode (:class:`_Counting`) counts what
every operator would do: the floating-point operations by ``torch.utils.flop_counter``'s formulas, the bytes of
each operator's tensor arguments and results, and the operators (views, which move nothing, are left out). The
count is the same on every machine and every run.

It runs under ``FakeTensorMode``: the ``meta`` tensors are fake ones, which libraries recognise as traced and
keep off data-dependent paths (transformers' attention masks read a mask's values with ``.item()`` unless a
tensor is fake): a Hugging Face decoder layer is counted as a plain layer is; its routed experts, which pick
by value, as every token's ``top_k`` experts (:mod:`.routed_experts`).

A layer that repeats the one before (the same classes, parameter shapes and attribute values in every submodule,
and an input of the same shapes) is not run again: its count is the earlier layer's. A model's decoder layers
differ only in their position (``layer_idx`` and its kin, :data:`INDEX_NAMES`), so a 32-layer model is counted in
about the time of one layer, not 32 (the count ran at ~0.25 s of Python dispatch per decoder layer on 2026-12-06).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import flop_registry

from ...partition.estimate import CountedLayer
from .routed_experts import uniform_routing

#: a submodule's attributes that say where a layer sits, not what it does (transformers' ``layer_idx``, Megatron's
#: ``layer_number``): left out of the key that tells a repeated layer (:func:`_work_key`), with those a class names
#: in its ``position_attributes`` (a stage of stagewise's that holds a range of a model's layers)
INDEX_NAMES = frozenset({"layer_idx", "layer_id", "layer_index", "layer_number"})
_OWN = frozenset({"_parameters", "_buffers", "_modules"})  # a module's tensors and children: keyed apart


class _Counting(TorchDispatchMode):
    """FLOPs (``torch.utils.flop_counter``'s formulas, an operator without one taken apart where it decomposes, as
    ``FlopCounterMode`` does, without its per-module tracking: 40 % of the count's time), and the bytes of every
    non-view operator's tensor arguments and results with how many such operators ran, as the layer called them
    (``prim``'s, a fake tensor's questions about itself, are none)."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0
        self.bytes = 0.0
        self.ops = 0
        self._inside = 0  # > 0: an operator's decomposition, whose parts' FLOPs count and bytes do not

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        args, kwargs = _all_on_meta((args, kwargs or {}))
        out = self._run(func, args, kwargs)
        if self._inside == 0 and not getattr(func, "is_view", False) and getattr(func, "namespace", "") != "prim":
            self.ops += 1
            for t in tree_flatten((args, kwargs, out))[0]:
                if isinstance(t, torch.Tensor):
                    self.bytes += t.numel() * t.element_size()
        return out

    def _run(self, func: Any, args: Any, kwargs: Any) -> Any:
        formula = flop_registry.get(func.overloadpacket)
        if formula is None and func not in _QUESTIONS:
            self._inside += 1
            try:
                with self:
                    parts = func.decompose(*args, **kwargs)
            finally:
                self._inside -= 1
            if parts is not NotImplemented:
                return parts
        out = func(*args, **kwargs)
        if formula is not None:
            self.flops += formula(*args, **kwargs, out_val=out)
        return out


#: a tensor's questions about itself, which ``FlopCounterMode`` neither counts nor takes apart
_QUESTIONS = frozenset({
    torch.ops.aten.sym_is_contiguous.default, torch.ops.aten.is_contiguous.default,
    torch.ops.aten.is_contiguous.memory_format, torch.ops.aten.is_strides_like_format.default,
    torch.ops.aten.is_non_overlapping_and_dense.default, torch.ops.aten.size.default, torch.ops.aten.sym_size.default,
    torch.ops.aten.stride.default, torch.ops.aten.sym_stride.default, torch.ops.aten.storage_offset.default,
    torch.ops.aten.sym_storage_offset.default, torch.ops.aten.numel.default, torch.ops.aten.sym_numel.default,
    torch.ops.aten.dim.default, torch.ops.prim.layout.default, torch.ops.prim.device.default,
})  # fmt: skip


def count_layers(names: Sequence[str], build: Callable[[int], nn.Module], sample_inputs: Any) -> list[CountedLayer]:
    """One :class:`CountedLayer` per layer for one micro-batch ``sample_inputs`` (any device); ``build(k)``
    makes layer ``k`` (called under ``torch.device("meta")``, the global RNG state kept)."""
    fake = FakeTensorMode(allow_non_fake_inputs=True)  # (a module given already built: its real tensors)
    seen: dict[Hashable, tuple[CountedLayer, Any]] = {}  # a repeated layer's count and output, by its work key
    with torch.random.fork_rng(devices=[]), torch.device("meta"), fake:
        x: Any = tree_map(_meta_leaf, sample_inputs)
        counted = []
        for k, name in enumerate(names):
            module = build(k)
            args = x if type(x) is tuple else (x,)
            key = _work_key(module, args)
            if key is not None and key in seen:
                layer_count, out = seen[key]
                layer_count = replace(layer_count, name=name)
            else:
                layer_count, out = _count(name, module, args)
                if key is not None:
                    seen[key] = layer_count, out
            counted.append(layer_count)
            x = tree_map(_meta_leaf, out)
    return counted


def _work_key(module: nn.Module, args: tuple[Any, ...]) -> Hashable | None:
    """What decides a layer's count, as a value: per submodule its path, class, parameters' and buffers' shapes
    and dtypes and its other attributes by value (but those of its position), and the input's tree and shapes; None
    where an attribute has no value to compare (then the layer is counted)."""
    memo: dict[int, Hashable] = {}
    try:
        parts: list[Hashable] = []
        for path, sub in module.named_modules(remove_duplicate=False):
            tensors = [*sub.named_parameters(recurse=False), *sub.named_buffers(recurse=False)]
            skip = _OWN | INDEX_NAMES | getattr(type(sub), "position_attributes", frozenset())
            attrs = {k: v for k, v in vars(sub).items() if k not in skip}
            specs = tuple((n, _tensor_spec(t)) for n, t in tensors)
            parts.append((path, type(sub), specs, _frozen(attrs, memo)))
        leaves, spec = tree_flatten(args)
        inputs = tuple(_tensor_spec(t) if isinstance(t, torch.Tensor) else _frozen(t, memo) for t in leaves)
        parts.append((str(spec), inputs))
        key = tuple(parts)
        hash(key)
    except (_NoValue, TypeError):
        return None
    return key


class _NoValue(Exception):
    """An attribute whose value cannot be compared (the layer is counted, not matched)."""


def _tensor_spec(t: torch.Tensor | None) -> Hashable:
    if t is None:
        return None
    return tuple(t.shape), t.dtype, t.requires_grad


def _frozen(v: Any, memo: dict[int, Hashable], depth: int = 0) -> Hashable:
    """``v`` as a hashable value that equals another's where both would act alike: containers and plain objects by
    their contents (to a depth of 4), functions and classes by identity, tensors (not the module's own) by shape."""
    if v is None or isinstance(v, (bool, int, float, complex, str, bytes, type, torch.dtype, torch.device)):
        return v
    if id(v) in memo:
        return memo[id(v)]
    if depth > 4:
        raise _NoValue
    out: Hashable
    if isinstance(v, torch.Tensor):
        out = ("tensor", _tensor_spec(v))
    elif isinstance(v, (list, tuple)):
        out = (type(v).__name__, tuple(_frozen(x, memo, depth + 1) for x in v))
    elif isinstance(v, (set, frozenset)):
        out = ("set", frozenset(_frozen(x, memo, depth + 1) for x in v))
    elif isinstance(v, dict):
        out = ("dict", tuple((_frozen(k, memo, depth + 1), _frozen(x, memo, depth + 1)) for k, x in v.items()))
    elif isinstance(v, functools.partial):
        out = ("partial", _frozen((v.func, v.args, v.keywords), memo, depth + 1))
    elif isinstance(v, nn.Module) or callable(v) and not hasattr(v, "__dict__"):
        out = ("same", v)  # (a module outside ``_modules``, a builtin: only itself acts as itself; the key holds it,
        # so that a layer freed after its count cannot leave its id to another object)
    elif callable(v) and hasattr(v, "__code__"):
        out = ("function", v)  # (a function object by identity: hashable, equal only to itself)
    elif hasattr(v, "__dict__"):
        out = (type(v), _frozen(vars(v), memo, depth + 1))
    else:
        raise _NoValue
    memo[id(v)] = out
    return out


def _count(name: str, module: nn.Module, args: tuple[Any, ...]) -> tuple[CountedLayer, Any]:
    state = {
        n: torch.empty_like(t, device="meta").requires_grad_(t.requires_grad and t.is_floating_point())
        for n, t in [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    }
    params = [t for n, t in module.named_parameters() if t.requires_grad]
    with _Counting() as counting, uniform_routing(module):
        out = torch.func.functional_call(module, state, args, tie_weights=True, strict=False)
    forward = (counting.flops, counting.bytes, counting.ops)
    roots = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    with _Counting() as counting:
        if roots:
            torch.autograd.backward(roots, [torch.ones_like(t) for t in roots])
    backward = (counting.flops, counting.bytes, counting.ops)
    sent = sum(t.numel() * t.element_size() for t in tree_flatten(out)[0] if _floating(t))
    counted = CountedLayer(
        name=name,
        forward_flops=float(forward[0]),
        backward_flops=float(backward[0]),
        forward_bytes=forward[1],
        backward_bytes=backward[1],
        forward_ops=forward[2],
        backward_ops=backward[2],
        parameters=float(sum(p.numel() for p in params)),
        parameter_bytes=float(sum(p.numel() * p.element_size() for p in params)),
        output_bytes=float(sent),
    )
    return counted, out


def _all_on_meta(tree: Any) -> Any:
    """An operator's tensors all on ``meta`` where a real one meets ``meta`` ones (a table the model keeps outside
    the counted module's state, as GPT-J's rotary sines): nothing is computed, so only its shape counts."""
    leaves = [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]
    if all(t.is_meta for t in leaves) or not any(t.is_meta for t in leaves):
        return tree
    return tree_map(
        lambda t: t if not isinstance(t, torch.Tensor) or t.is_meta else torch.empty_like(t, device="meta"), tree
    )


def _floating(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point()


def _meta_leaf(t: Any) -> Any:
    """A tensor as a ``meta`` leaf, needing a gradient where it is floating (as a stage's input would)."""
    if not isinstance(t, torch.Tensor):
        return t
    leaf = torch.empty_like(t, device="meta")
    return leaf.requires_grad_(t.is_floating_point())
