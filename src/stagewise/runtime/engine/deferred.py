"""The ops whose weight gradient W computes (see :mod:`.backward`): how I recognises them, and W's kernels.

Roughly, an autograd node is a deferred op when its weight slot leads, through
at most a transpose and one cast, to a leaf that nothing else in the graph
uses, with no hooks, a plain tensor (or a DTensor, for a linear op):

  AddmmBackward0  addmm(b, x, w.t())   nn.Linear, F.linear (x flattened to 2-D)   dw = g.T x
                  addmm(b, x, w)       transformers' Conv1D                      dw = x.T g
  MmBackward0     mm(x, w.t()) / mm(x, w)   a linear layer without bias            (as above)
  ConvolutionBackward0                 nn.Conv1d/2d/3d, transposed too    aten.convolution_backward

Only the weight waits: a bias gradient needs the output gradient alone, which
I holds in cache as it makes it, so the op makes it in I, in the engine, as
Megatron-LM's weight-gradient store leaves it (deferring it measured 4 % more
I + W on the demo GPT: W re-reads each gradient for a small reduction). Each
kernel is the one the engine runs (``mm_mat2_backward`` of a transposed
``mat2`` is ``g.T @ x``), in the op's dtype, then cast to the leaf's like
``ToCopyBackward0`` and accumulated like ``AccumulateGrad``.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.checkpoint

Node = Any  # torch.autograd.graph.Node

# the node types (compared by identity: a walk over every node of a stage's graph should cost little)
_FN: Any = torch._C._functions
ADDMM, MM, CONV = _FN.AddmmBackward0, _FN.MmBackward0, _FN.ConvolutionBackward0
OPS = (ADDMM, MM, CONV)
_ACCUMULATE, _T, _CAST = _FN.AccumulateGrad, _FN.TBackward0, _FN.ToCopyBackward0
#: what a non-reentrant checkpoint saves in place of a tensor (the packed value of its saved-tensor hooks)
_HOLDER: Any = getattr(torch.utils.checkpoint, "_Holder", None)


@dataclass(eq=False)
class Op:
    """A deferred op: its node (alive during I only), its weight, and how to make the weight's gradient."""

    node: Node
    weight: torch.Tensor
    transposed: bool  # the op used ``w.t()`` (a linear layer) rather than ``w`` (Conv1D); unused for a convolution
    cast: bool  # the weight reached the op through a cast (autocast)
    conv: tuple[Any, ...] | None  # a convolution's (stride, padding, dilation, transposed, output padding, groups)
    accumulator: Node  # the weight's AccumulateGrad node (I leaves it out)

    def accumulate(self, x: torch.Tensor, g: torch.Tensor) -> None:
        """Add this op's weight gradient, from its input ``x`` and output gradient ``g``, to ``.grad``."""
        weight = self.weight
        if self.conv is not None:
            w = weight.to(g.dtype) if self.cast else weight
            _, gw, _ = torch.ops.aten.convolution_backward(g, x, w, None, *self.conv, [False, True, False])
            _add(weight, gw, self.cast)
            return
        a, b = (g.t(), x) if self.transposed else (x.t(), g)
        if weight.grad is not None and not self.cast and not is_dtensor(weight):
            weight.grad.addmm_(a, b)
        else:
            _add(weight, torch.mm(a, b), self.cast)


def _add(leaf: torch.Tensor, grad: torch.Tensor, cast: bool) -> None:
    """``AccumulateGrad``: ``grad`` (cast to the leaf's dtype if the op saw a cast) into ``leaf.grad``."""
    if cast:
        grad = grad.to(leaf.dtype)
    if leaf.grad is not None:
        leaf.grad.add_(grad)
    elif is_dtensor(leaf) or grad.stride() == leaf.stride():  # (a DTensor's placements come from the op, as B's)
        leaf.grad = grad
    else:  # the gradient takes the parameter's layout, as the engine's
        leaf.grad = torch.empty_strided(leaf.shape, leaf.stride(), dtype=leaf.dtype, device=leaf.device).copy_(grad)


def deferred_op(node: Node, uses: dict[Node, int], input_ids: set[int]) -> Op | None:
    """``node`` as a deferred op if its weight is a leaf only it uses, not a stage input (``input_ids``: their
    ``id``); else None."""
    kind = type(node)
    if kind is ADDMM and (node._saved_alpha != 1 or node._saved_beta != 1):
        return None
    found = _chain(node.next_functions[2 if kind is ADDMM else 1][0], uses, input_ids, allow_t=kind is not CONV)
    if found is None:
        return None
    leaf, transposed, cast, acc = found
    conv = None
    if kind is CONV:
        conv = (
            node._saved_stride,
            node._saved_padding,
            node._saved_dilation,
            node._saved_transposed,
            node._saved_output_padding,
            node._saved_groups,
        )
    return Op(node, leaf, transposed, cast, conv, acc)


def _chain(
    slot: Node, uses: dict[Node, int], input_ids: set[int], *, allow_t: bool
) -> tuple[torch.Tensor, bool, bool, Node] | None:
    """(leaf, transposed, cast, its AccumulateGrad) if ``slot`` is ``[TBackward0] [ToCopyBackward0]
    AccumulateGrad`` of a deferrable leaf, each node used once; else None."""
    transposed = cast = False
    node = slot
    if allow_t and type(node) is _T and uses.get(node) == 1:
        transposed, node = True, node.next_functions[0][0]
    if type(node) is _CAST and uses.get(node) == 1:
        cast, node = True, node.next_functions[0][0]
    if type(node) is not _ACCUMULATE or uses.get(node) != 1 or id(node.variable) in input_ids:
        return None
    leaf = _deferrable(node.variable, conv=not allow_t)
    if leaf is None or (allow_t and leaf.dim() != 2):
        return None
    return leaf, transposed, cast, node


def _deferrable(leaf: torch.Tensor, conv: bool) -> torch.Tensor | None:
    """The leaf, if W may accumulate its gradient by hand: a plain dense tensor or Parameter without hooks, or
    a tensor-parallel one (a DTensor: W's ``mm`` goes through DTensor's dispatch as the engine's does; not
    for a convolution)."""
    dtensor = is_dtensor(leaf)
    plain = type(leaf) in (torch.Tensor, torch.nn.Parameter)
    if not (plain or (dtensor and not conv)) or leaf._backward_hooks or leaf.layout != torch.strided:
        return None
    if getattr(leaf, "_post_accumulate_grad_hooks", None):
        return None
    grad, want = leaf.grad, type(leaf) if dtensor else torch.Tensor
    if grad is not None and (type(grad) is not want or grad.layout != torch.strided):
        return None
    return leaf


def is_dtensor(t: torch.Tensor) -> bool:
    """Whether ``t`` is a DTensor (by its type's name: torch.distributed lives in runtime/comm and hybrid)."""
    kind = type(t)
    return kind.__name__ == "DTensor" and kind.__module__.startswith("torch.distributed.tensor")


def weight_leaf(node: Node) -> torch.Tensor | None:
    """The leaf behind an op's weight slot (through a transpose and a cast), without checks: for matching a
    recomputed op to its original by the weight's identity."""
    slot = node.next_functions[2 if type(node) is ADDMM else 1][0]
    while type(slot) is _T or type(slot) is _CAST:
        slot = slot.next_functions[0][0]
    return slot.variable if type(slot) is _ACCUMULATE else None


def in_checkpoint(node: Node) -> bool:
    """Whether the input an op saved is a checkpoint's placeholder (read once per backward, recomputed);
    if torch no longer names the placeholder's type, every op is taken to be in one (left to I, unless
    recomputed by stagewise's closure)."""
    kind = type(node)
    raw = node._raw_saved_mat1 if kind is ADDMM else node._raw_saved_self if kind is MM else node._raw_saved_input
    return _HOLDER is None or isinstance(raw.data, _HOLDER)


def saved_input(node: Node) -> torch.Tensor:
    """The input ``x`` an op saved for its backward (unpacks it: once per graph task under a checkpoint)."""
    kind = type(node)
    x: torch.Tensor = node._saved_mat1 if kind is ADDMM else node._saved_self if kind is MM else node._saved_input
    return x


def scan(roots: Sequence[Node], outside: Collection[Node] = ()) -> tuple[list[Node], list[Node], dict[Node, int]]:
    """One walk over the nodes reachable from ``roots`` without entering ``outside``: the candidate ops, the
    AccumulateGrad nodes (leaves), and how many edges of the graph point at each node."""
    ops: list[Node] = []
    leaves: list[Node] = []
    uses: dict[Node, int] = {}
    seen = {*roots, *outside}
    stack = [r for r in roots if r not in outside]
    while stack:
        node = stack.pop()
        kind = type(node)
        if kind is _ACCUMULATE:
            leaves.append(node)
            continue
        if kind is ADDMM or kind is MM or kind is CONV:
            ops.append(node)
        for child, _ in node.next_functions:
            if child is not None:
                uses[child] = uses.get(child, 0) + 1
                if child not in seen:
                    seen.add(child)
                    stack.append(child)
    return ops, leaves, uses
