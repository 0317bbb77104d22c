"""Counting a layer list's work on the ``meta`` device: FLOPs, bytes moved and operators, per layer.

What ``partition="balanced"`` (the default) cuts by (:mod:`stagewise.partition.estimate`). Nothing is
computed and nothing is timed: each layer is built on ``meta`` (a module given already built is called
with ``meta`` copies of its parameters through ``torch.func.functional_call``), one micro-batch of the
sample inputs, moved to ``meta``, goes forward and back, and two dispatch modes count what every operator
would do: ``torch.utils.flop_counter.FlopCounterMode`` the floating-point operations, :class:`_Traffic` the
bytes of each operator's tensor arguments and results and the operators (views, which move nothing, are
left out). The count is the same on every machine and every run.

It runs under ``FakeTensorMode``: the ``meta`` tensors are fake ones, which libraries recognise as traced and
keep off data-dependent paths (transformers' attention masks read a mask's values with ``.item()`` unless a
tensor is fake): a Hugging Face decoder layer is counted as a plain layer is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import FlopCounterMode

from ...partition.estimate import CountedLayer


class _Traffic(TorchDispatchMode):
    """Bytes of every non-view operator's tensor arguments and results, and how many such operators ran (``prim``'s,
    a fake tensor's questions about itself, are none)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0.0
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        args, kwargs = _all_on_meta((args, kwargs or {}))
        out = func(*args, **kwargs)
        if not getattr(func, "is_view", False) and getattr(func, "namespace", "") != "prim":  # (a fake's device)
            self.ops += 1
            for t in tree_flatten((args, kwargs, out))[0]:
                if isinstance(t, torch.Tensor):
                    self.bytes += t.numel() * t.element_size()
        return out


def count_layers(names: Sequence[str], build: Callable[[int], nn.Module], sample_inputs: Any) -> list[CountedLayer]:
    """One :class:`CountedLayer` per layer for one micro-batch ``sample_inputs`` (any device); ``build(k)``
    makes layer ``k`` (called under ``torch.device("meta")``, the global RNG state kept)."""
    fake = FakeTensorMode(allow_non_fake_inputs=True)  # (a module given already built: its real tensors)
    with torch.random.fork_rng(devices=[]), torch.device("meta"), fake:
        x: Any = tree_map(_meta_leaf, sample_inputs)
        counted = []
        for k, name in enumerate(names):
            module = build(k)
            args = x if type(x) is tuple else (x,)
            layer_count, out = _count(name, module, args)
            counted.append(layer_count)
            x = tree_map(_meta_leaf, out)
    return counted


def _count(name: str, module: nn.Module, args: tuple[Any, ...]) -> tuple[CountedLayer, Any]:
    state = {
        n: torch.empty_like(t, device="meta").requires_grad_(t.requires_grad and t.is_floating_point())
        for n, t in [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    }
    params = [t for n, t in module.named_parameters() if t.requires_grad]
    with FlopCounterMode(display=False) as flops, _Traffic() as traffic:
        out = torch.func.functional_call(module, state, args, tie_weights=True, strict=False)
    forward = (flops.get_total_flops(), traffic.bytes, traffic.ops)
    roots = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    with FlopCounterMode(display=False) as flops, _Traffic() as traffic:
        if roots:
            torch.autograd.backward(roots, [torch.ones_like(t) for t in roots])
    backward = (flops.get_total_flops(), traffic.bytes, traffic.ops)
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
