"""Backward of one stage for one micro-batch: whole (B), input part (I), weight part (W).

B is one ``autograd.backward``. Zero-bubble schedules split it so the
previous stage gets its gradient early (I) and the weight gradients fill
bubbles later (W), without running the forward or the whole backward twice:

* I walks the stage's autograd graph once and marks which nodes lead to the
  stage's inputs and which to its weights (the leaves that are not inputs). It
  runs ``autograd.grad`` towards the inputs only, so the engine skips every
  node and every output that serves only weights (no weight gradient is
  made). Pre-hooks on the *boundary* nodes - nodes on the input path with an
  edge that leaves it towards weights (``AddmmBackward`` of a linear layer) -
  save the gradients flowing into them. The graph is retained.
* W restarts the engine from those boundary nodes (as ``GradientEdge`` roots,
  fed the saved gradients) towards the weights only: boundary nodes compute
  just their weight outputs, and the weight-only nodes behind them run once.
  Roots that never reach an input (stage 0, whose data needs no gradient) are
  restarted as they are, so there W does the whole work and I nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

# ``torch.autograd.backward`` / ``grad`` given output gradients import this - and sympy, some 500 modules,
# seconds on a loaded machine - on their first call. Imported with the library instead: inside a rank's first
# backward it held up every rank waiting for that gradient, past the pipeline's timeout (issue 17).
import torch.fx.experimental.symbolic_shapes  # noqa: F401  (imported for its cost, see above)
from torch.autograd.graph import GradientEdge, get_gradient_edge

Node = Any  # torch.autograd.graph.Node


def backward_full(
    roots: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None], inputs: Sequence[torch.Tensor]
) -> list[torch.Tensor | None]:
    """B: weight gradients accumulate into ``.grad``; returns the gradient of each input (None if unused)."""
    pairs = [(r, g) for r, g in zip(roots, grads) if r.requires_grad]
    if pairs:
        torch.autograd.backward([r for r, _ in pairs], [g for _, g in pairs])
    return [x.grad for x in inputs]


@dataclass
class WeightWork:
    """What I leaves for W: engine restarts, each (roots, their gradients, the leaves it may reach)."""

    calls: list[tuple[list[Any], list[torch.Tensor], list[torch.Tensor]]] = field(default_factory=list)


def backward_input(
    roots: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None], inputs: Sequence[torch.Tensor]
) -> tuple[list[torch.Tensor | None], WeightWork]:
    """I: the gradient of each input (None if unused) and the pending weight work; no ``.grad`` changes."""
    pairs = [(r, g if g is not None else torch.ones_like(r)) for r, g in zip(roots, grads) if r.requires_grad]
    work = WeightWork()
    if not pairs:
        return [None] * len(inputs), work
    root_edges = [get_gradient_edge(r) for r, _ in pairs]
    input_nodes = {get_gradient_edge(x).node for x in inputs}
    graph = _Graph([e.node for e in root_edges], input_nodes)

    saved: dict[Node, tuple[torch.Tensor | None, ...]] = {}
    hooks = [node.register_prehook(_saver(saved, node)) for node in graph.regions] if graph.clean else []
    try:
        reached = [x for x in inputs if graph.to_input.get(get_gradient_edge(x).node, False)]
        got: dict[int, torch.Tensor | None] = {}
        if reached:
            live = [(r, g) for (r, g), e in zip(pairs, root_edges) if graph.to_input[e.node]]
            result = torch.autograd.grad(
                [r for r, _ in live], reached, [g for _, g in live], retain_graph=True, allow_unused=True
            )
            got = {id(x): g for x, g in zip(reached, result)}
    finally:
        for h in hooks:
            h.remove()

    if not graph.clean:
        # Weights reached from two places (e.g. one weight used by two layers of the stage): restart
        # from the roots. Exact, but the input path runs again.
        work.calls.append(([r for r, _ in pairs], [g for _, g in pairs], graph.all_weights))
        return [got.get(id(x)) for x in inputs], work
    for node, weights in graph.regions.items():
        edges = [(GradientEdge(node, k), g) for k, g in enumerate(saved.get(node, ())) if g is not None]
        if edges and weights:
            work.calls.append(([e for e, _ in edges], [g for _, g in edges], weights))
    outside = [(e, g) for (_, g), e in zip(pairs, root_edges) if not graph.to_input[e.node]]
    if outside and graph.root_weights:
        work.calls.append(([e for e, _ in outside], [g for _, g in outside], graph.root_weights))
    return [got.get(id(x)) for x in inputs], work


def backward_weight(work: WeightWork) -> None:
    """W: accumulate the weight gradients left by :func:`backward_input` into ``.grad``, freeing the graph."""
    for edges, grads, weights in work.calls:
        torch.autograd.backward(edges, grad_tensors=grads, inputs=weights)
    work.calls.clear()


class _Graph:
    """One walk over a stage's autograd graph: what leads to the inputs, and who owns each weight.

    A node *leads to the input* if an input leaf is reachable from it. The
    nodes that do not, but reach a weight, form regions hanging off the input
    path; each region is *owned* by the input-path node (boundary) whose edges
    enter it. The split is exact when every region node has one owner:
    restarting from a boundary towards its own weights then cannot wander back
    onto the input path. Regions reachable from roots that never touch the
    input path are restarted from those roots.
    """

    def __init__(self, roots: Sequence[Node], input_nodes: set[Node]) -> None:
        order = _post_order(roots)
        root_set = set(roots)
        self.to_input: dict[Node, bool] = {}
        to_weight: dict[Node, bool] = {}
        leaves: list[Node] = []
        for node in order:  # children first
            children = [c for c, _ in node.next_functions if c is not None]
            is_weight = hasattr(node, "variable") and node not in input_nodes
            self.to_input[node] = node in input_nodes or any(self.to_input[c] for c in children)
            to_weight[node] = is_weight or any(to_weight[c] for c in children)
            if is_weight:
                leaves.append(node)
        self.all_weights = [n.variable for n in leaves]

        owner: dict[Node, Node] = {}
        from_roots: set[Node] = set()
        self.clean = True
        for node in reversed(order):  # parents first
            src = node if self.to_input[node] else owner.get(node)
            outside_root = node in root_set and not self.to_input[node]
            for c, _ in node.next_functions:
                if c is None or self.to_input[c] or not to_weight[c]:
                    continue
                if outside_root or node in from_roots:
                    from_roots.add(c)
                if src is not None and owner.setdefault(c, src) is not src:
                    self.clean = False
            if outside_root:
                from_roots.add(node)
        self.regions: dict[Node, list[torch.Tensor]] = {}
        for node in set(owner.values()):
            self.regions[node] = []
        for leaf in leaves:
            if leaf in owner:
                self.regions[owner[leaf]].append(leaf.variable)
        self.root_weights = [leaf.variable for leaf in leaves if leaf in from_roots]


def _saver(saved: dict[Node, tuple[torch.Tensor | None, ...]], node: Node) -> Any:
    def hook(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        saved[node] = tuple(grad_outputs)

    return hook


def _post_order(roots: Sequence[Node]) -> list[Node]:
    """Every node reachable from ``roots``, each after all of its children (iterative DFS)."""
    order: list[Node] = []
    seen: set[Node] = set()
    stack: list[tuple[Node, bool]] = [(r, False) for r in roots]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if node in seen:
            continue
        seen.add(node)
        stack.append((node, True))
        stack.extend((c, False) for c, _ in node.next_functions if c is not None and c not in seen)
    return order
