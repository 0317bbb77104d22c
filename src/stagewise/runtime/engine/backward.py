"""Backward of one stage for one micro-batch: whole (B), input part (I), weight part (W).

Zero-bubble schedules (Qi et al., *Zero Bubble Pipeline Parallelism*, ICLR
2024) split B so the previous stage gets its gradient early (I) and the weight
gradients fill bubbles later (W). The split here is the paper's, and Megatron's
weight-gradient store: I does B's work but the deferred weight gradients, W
does those, nothing twice.

* I walks the stage's autograd graph once and finds the *deferred* weights:
  leaves (without hooks; plain tensors, or tensor parallelism's DTensors for a
  linear op, whose W then dispatches as B would) whose one use in the graph is the
  weight of an op whose weight gradient needs only the op's input and its
  output gradient - a linear layer ``addmm(b, x, w.t())`` / ``mm(x, w.t())``
  (``nn.Linear``, a 3-D input's flattened view included; fused QKV; the tied
  head ``F.linear(h, wte.weight)``), transformers' ``Conv1D``
  ``addmm(b, x, w)``, a convolution (``ConvolutionBackward0``). Under autocast
  the weight reaches the op through one cast (``ToCopyBackward0``), which W
  replays. A weight used twice stays in I; so do biases (see :mod:`.deferred`).
* I is ONE engine pass that frees the graph as it goes:
  ``torch.autograd.backward(roots, inputs=stage inputs + every other leaf +
  GradientEdge(op) for each deferred op)``. A ``GradientEdge`` marks its op
  as needed, so the op runs and gets its output gradient even where nothing
  below it needs one (the first linear of stage 0), but computes only the
  outputs that lead to something needed: the deferred weight gradients are
  never made. A pre-hook on each deferred op stashes its output gradient and
  its input (the tensor the op saved for backward). LayerNorm, embeddings and
  anything unrecognised get their gradients in I.
* W runs the stashed kernels into ``.grad``: ``weight.grad.addmm_(g.T, x)``
  (the gradient-accumulation fusion of Megatron-LM: no temporary, no second
  pass over a weight-sized matrix) or ``aten.convolution_backward`` with
  ``output_mask = [False, True, False]``; under autocast in the op's dtype,
  then cast to the leaf's, as the engine does. Between I and W only the stash is alive: the op inputs (tensors the
  forward saved anyway) and the output gradients, the paper's M_W.
* A recomputed stage (:mod:`..features.recompute`): every tensor a
  checkpointed segment saved may be unpacked once per backward, and the op's
  own backward unpacks its input, so the pre-hook may not read it. Instead
  the segment's recompute - which I's pass triggers, once - runs our own
  closure, which hands its outputs to :func:`note_recomputed`: while I runs,
  that walks the recomputed segment's graph and keeps, for each deferred
  weight (found by identity: it has one use), the recomputed op's saved input,
  the very tensor the original op then unpacks (same values, same storage).
  W re-runs no forward. An op is in a checkpoint when what it saved is a
  checkpoint's placeholder (``torch.utils.checkpoint._Holder``); ``checkpointed``
  names the weights whose segments run our closure (a stage's, with
  ``recompute=``); ops in other checkpoints stay in I. The checkpoint runs
  without early stop, so each segment is recomputed to its end.
* B is one engine ``backward``, or - for a stage whose weights are large
  enough that the fused accumulation repays the walk (``fused=True``, the
  ``compute.fuses_b``) - I then W at once.

:meth:`WeightWork.held_bytes` is what W holds (each stashed byte once); the
memory meter charges it from the end of I to the end of W.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

# ``torch.autograd.backward`` / ``grad`` given output gradients import this - and sympy, some 500 modules,
# seconds on a loaded machine - on their first call. Imported with the library instead: inside a rank's first
# backward it held up every rank waiting for that gradient, past the pipeline's timeout (issue 17).
import torch.fx.experimental.symbolic_shapes  # noqa: F401  (imported for its cost, see above)
from torch.autograd.graph import GradientEdge, get_gradient_edge

from .deferred import Op, deferred_op, in_checkpoint, is_dtensor, saved_input, scan, weight_leaf
from .spans import byte_span, union_bytes

Node = Any  # torch.autograd.graph.Node


@dataclass
class _Stashed:
    """One deferred op's weight-gradient inputs: the op's input ``x`` and output gradient ``g``."""

    op: Op
    g: torch.Tensor
    x: torch.Tensor | None = None


class WeightWork:
    """What I leaves for W: per deferred op, its input and output gradient (no autograd graph)."""

    def __init__(self, stash: list[_Stashed] | None = None) -> None:
        self.stash: list[_Stashed] = stash if stash is not None else []
        self.done = False

    def held_bytes(self) -> int:
        """Bytes W holds until it runs: the stashed inputs and gradients, each byte of a storage once (a view into
        a larger storage - a micro-batch of the step's batch - counts what it spans, not the whole storage)."""
        spans: dict[int, list[tuple[int, int]]] = {}
        for item in self.stash:
            for t in (item.x, item.g):
                t = t.to_local() if t is not None and is_dtensor(t) else t  # type: ignore[attr-defined]  # its shard
                if t is not None and t.numel() > 0:
                    storage, start, end = byte_span(t)
                    spans.setdefault(storage, []).append((start, end))
        return sum(union_bytes(v) for v in spans.values())

    def __len__(self) -> int:
        return len(self.stash)


def backward_full(
    roots: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    inputs: Sequence[torch.Tensor],
    *,
    fused: bool = True,
) -> list[torch.Tensor | None]:
    """B: weight gradients accumulate into ``.grad``; returns the gradient of each input (None if unused).

    ``fused=True`` runs I then W at once (the fused accumulation of the linear layers' weight gradients saves
    the engine's temporary and its add to ``.grad``); ``fused=False`` one engine pass (a recomputed stage, or
    one whose weights are too small to repay the walk: the assembly decides: ``compute.StageFacts``).
    """
    pairs = [(r, g) for r, g in zip(roots, grads) if r.requires_grad]
    if not pairs:
        return [x.grad for x in inputs]
    if fused:
        input_grads, work = backward_input(roots, grads, inputs)
        backward_weight(work)
        return input_grads
    torch.autograd.backward([r for r, _ in pairs], [g for _, g in pairs])
    return [x.grad for x in inputs]


def backward_input(
    roots: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    inputs: Sequence[torch.Tensor],
    *,
    checkpointed: Collection[torch.Tensor] = (),
) -> tuple[list[torch.Tensor | None], WeightWork]:
    """I: the gradient of each input (None if unused), every parameter gradient but the deferred ones (into
    ``.grad``), and the work W has left; the graph is freed.

    ``checkpointed``: the weights of a recomputed stage, whose segments run :mod:`..features.recompute`'s
    closure: an op of theirs inside a checkpoint takes its input from the segment's recompute (see the module
    docstring); an op inside any other checkpoint is left to I. The inputs' own ``.grad`` is left as it was.
    """
    pairs = [(r, g if g is not None else torch.ones_like(r)) for r, g in zip(roots, grads) if r.requires_grad]
    if not pairs:
        return [None] * len(inputs), WeightWork()
    reached = [x for x in inputs if x.requires_grad]
    input_ids = {id(x) for x in reached}
    root_nodes = [r.grad_fn if r.grad_fn is not None else get_gradient_edge(r).node for r, _ in pairs]
    candidates, accumulators, uses = scan(root_nodes)
    ops, wanted = _deferred(candidates, uses, input_ids, {id(t) for t in checkpointed})
    taken = {op.accumulator for op in ops}
    leaves = [n.variable for n in accumulators if n not in taken and id(n.variable) not in input_ids]
    stash: list[_Stashed] = []
    hooks = [op.node.register_prehook(_stasher(op, stash, id(op.weight) not in wanted)) for op in ops]
    kept = [x.grad for x in reached]
    capture = _Capture(wanted, [*uses, *root_nodes])
    try:
        for x in reached:
            x.grad = None
        targets: list[Any] = [*reached, *leaves, *(GradientEdge(op.node, 0) for op in ops)]
        if targets:
            with capture.active():
                torch.autograd.backward([r for r, _ in pairs], [g for _, g in pairs], inputs=targets)
        got = {id(x): x.grad for x in reached}
    finally:
        for h in hooks:
            h.remove()
        for x, g in zip(reached, kept):
            x.grad = g
    for item in stash:
        if item.x is None:
            item.x = capture.take(item.op)
    return [got.get(id(x)) for x in inputs], WeightWork(stash)


def _deferred(
    candidates: Sequence[Node], uses: dict[Node, int], input_ids: set[int], recomputed: set[int]
) -> tuple[list[Op], set[int]]:
    """The deferred ops, and the ids of their weights whose input a recompute hands over (the op lies in a
    checkpointed segment that runs our closure: its weight is in ``recomputed``). An op in any other checkpoint
    (torch's own ``checkpoint`` around a layer being profiled, say) stays in I: its input can be read neither
    in I (once per backward) nor after."""
    ops, wanted = [], set()
    for node in candidates:
        op = deferred_op(node, uses, input_ids)
        if op is None:
            continue
        if in_checkpoint(node):
            if id(op.weight) not in recomputed:
                continue
            wanted.add(id(op.weight))
        ops.append(op)
    return ops, wanted


def _stasher(op: Op, stash: list[_Stashed], read_input: bool) -> Any:
    """The pre-hook of a deferred op: stash its output gradient, and its input unless a recompute supplies it."""

    def hook(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        g = grad_outputs[0]
        if g is not None:
            stash.append(_Stashed(op, g, saved_input(op.node).detach() if read_input else None))

    return hook


class _Capture:
    """The inputs of deferred ops in checkpointed segments, taken from their recompute during I."""

    def __init__(self, wanted: set[int], original: Sequence[Node]) -> None:
        self.wanted = wanted  # ids of the deferred weights whose op lies in a checkpointed segment
        self.original = set(original) if wanted else set()  # the graph I runs: a recompute's walk stops there
        self.found: dict[int, torch.Tensor] = {}

    def active(self) -> Any:
        return _Active(self if self.wanted else None)

    def take(self, op: Op) -> torch.Tensor:
        x = self.found.pop(id(op.weight), None)
        if x is None:
            raise RuntimeError(
                f"I found no recomputed input for the {op.node.name()} of a weight of shape "
                f"{tuple(op.weight.shape)}: it lies in a checkpoint and is listed in checkpointed=, but its "
                "recompute did not run stagewise's closure (a segment checkpointed by other means?)"
            )
        return x


_ACTIVE: _Capture | None = None


class _Active:
    def __init__(self, capture: _Capture | None) -> None:
        self.capture = capture

    def __enter__(self) -> None:
        global _ACTIVE
        self.before, _ACTIVE = _ACTIVE, self.capture

    def __exit__(self, *exc: object) -> None:
        global _ACTIVE
        _ACTIVE = self.before


def capturing() -> bool:
    """Whether an I is running that wants its checkpointed segments' recomputed op inputs."""
    return _ACTIVE is not None


def note_recomputed(outputs: Iterable[Any]) -> None:
    """Called by a checkpointed segment's closure at the end of its recompute (inside I): keep the saved input of
    each op of a deferred weight (a tensor the recompute made for the original op to unpack)."""
    capture = _ACTIVE
    if capture is None:
        return
    roots = [t.grad_fn for t in outputs if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    for node in scan(roots, capture.original)[0]:  # the recomputed nodes: not the segment's inputs' makers
        leaf = weight_leaf(node)
        if leaf is not None and id(leaf) in capture.wanted:
            capture.found[id(leaf)] = saved_input(node).detach()


def backward_weight(work: WeightWork) -> None:
    """W: accumulate the weight gradients left by :func:`backward_input` into ``.grad``, freeing its stash."""
    if work.done:
        raise RuntimeError("W ran twice for one I: its weight gradients were accumulated already")
    with torch.no_grad():
        for item in work.stash:
            assert item.x is not None
            item.op.accumulate(item.x, item.g)
    work.stash.clear()
    work.done = True


__all__ = ["WeightWork", "backward_full", "backward_input", "backward_weight", "capturing", "note_recomputed"]
