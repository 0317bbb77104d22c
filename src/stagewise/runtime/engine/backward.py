"""Backward of one stage for one micro-batch: whole (B), input part (I), weight part (W).

Zero-bubble schedules split B so the previous stage gets its gradient early
(I) and the weight gradients fill bubbles later (W), without running the
forward or the whole backward twice:

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
* W of a plain linear layer (a boundary ``AddmmBackward0`` / ``MmBackward0``
  whose region is just its weight, behind a transpose, and its bias, leaves
  without hooks) skips the engine: ``weight.grad.addmm_(grad.T, input)`` and
  ``bias.grad.add_(grad.sum(0))``, the gradient-accumulation fusion of
  Megatron-LM. The engine would make the weight gradient in a temporary
  (``mm``) and then add its transpose to ``.grad``: for a micro-batch of a few
  rows these are memory-bound passes over a weight-sized matrix, and the
  fused pass writes one (measured on a 1024 x 1024 layer with 8 rows: 440 us
  against 690 us for mm + add_, more for the engine's transposed add;
  benchmarks/backward_kernels.py). Same sums, in float64 equal up to rounding;
  any other node goes through the engine as above.
* A stage whose input needs no gradient and whose leaves are all plain linear
  layers' weights and biases (a first stage of linear layers) has the engine
  carry the gradient only to each layer's output (``autograd.grad`` to the
  layers' ``GradientEdge``s: it runs no weight branch), then the same fused W.
* B is one ``autograd.backward``, except for a stage where the fused W
  applies: there it is I then W at once (a 2-layer stage of 1024-wide linear
  layers, 8 rows: 2.8 ms against 3.9 ms for the engine).
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
_Layer = tuple[Node, torch.Tensor, torch.Tensor, "torch.Tensor | None"]  # a linear layer: node, input, weight, bias


def backward_full(
    roots: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    inputs: Sequence[torch.Tensor],
    *,
    fused: bool = True,
) -> list[torch.Tensor | None]:
    """B: weight gradients accumulate into ``.grad``; returns the gradient of each input (None if unused).

    A stage with plain linear layers runs as I then W at once: the fused accumulation of their weight
    gradients costs less than the engine's temporary and (transposed) add. Otherwise (no such layer, a
    weight reached from two places, or ``fused=False``) it is one engine pass. ``fused=False`` for a
    recomputed (checkpointed) stage: reading a linear node's saved input there re-runs the stage's
    forward each time (measured: a recomputed GPT step 8x slower), so the engine, which unpacks once, runs it.
    """
    pairs = [(r, g) for r, g in zip(roots, grads) if r.requires_grad]
    if not pairs:
        return [x.grad for x in inputs]
    if not fused:
        torch.autograd.backward([r for r, _ in pairs], [g for _, g in pairs])
        return [x.grad for x in inputs]
    filled = [(r, g if g is not None else torch.ones_like(r)) for r, g in pairs]
    root_edges, graph = _graph_of(filled, inputs)
    linear = any(_linear_parts(node, weights) for node, weights in graph.regions.items())
    if (graph.clean and linear) or (not any(graph.to_input.values()) and _only_linears(graph)):
        input_grads, work = _input_part(filled, inputs, root_edges, graph)
        backward_weight(work)
        return input_grads
    torch.autograd.backward([r for r, _ in pairs], [g for _, g in pairs])
    return [x.grad for x in inputs]


@dataclass
class WeightWork:
    """What I leaves for W: engine restarts, each (roots, their gradients, the leaves it may reach)."""

    calls: list[tuple[list[Any], list[torch.Tensor], list[torch.Tensor]]] = field(default_factory=list)
    #: linear layers W accumulates itself: (gradient of the output, input, weight, bias or None)
    linears: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]] = field(default_factory=list)
    #: a stage whose input needs no gradient and whose weights are all plain linear layers': its roots, their
    #: gradients, and per layer (node, input, weight, bias): the engine only carries gradients to the layers
    catches: list[tuple[list[Any], list[torch.Tensor], list[_Layer]]] = field(default_factory=list)


def backward_input(
    roots: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    inputs: Sequence[torch.Tensor],
    *,
    fused: bool = True,
) -> tuple[list[torch.Tensor | None], WeightWork]:
    """I: the gradient of each input (None if unused) and the pending weight work; no ``.grad`` changes.

    ``fused=False`` (a recomputed stage, see :func:`backward_full`): the whole backward, W included, through
    the engine, and no work left for W. W restarts the engine once per weight region, each a new graph task,
    and torch's non-reentrant checkpoint re-runs the stage's forward for every graph task that unpacks it:
    split, W of a stage of 3 GPT blocks took 7-8x its B (benchmarks/RESULTS.md).
    """
    if not fused:
        return backward_full(roots, grads, inputs, fused=False), WeightWork()
    pairs = [(r, g if g is not None else torch.ones_like(r)) for r, g in zip(roots, grads) if r.requires_grad]
    if not pairs:
        return [None] * len(inputs), WeightWork()
    root_edges, graph = _graph_of(pairs, inputs)
    return _input_part(pairs, inputs, root_edges, graph)


def _graph_of(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], inputs: Sequence[torch.Tensor]) -> tuple[Any, _Graph]:
    root_edges = [get_gradient_edge(r) for r, _ in pairs]
    input_nodes = {get_gradient_edge(x).node for x in inputs}
    return root_edges, _Graph([e.node for e in root_edges], input_nodes)


def _input_part(
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
    inputs: Sequence[torch.Tensor],
    root_edges: Any,
    graph: _Graph,
) -> tuple[list[torch.Tensor | None], WeightWork]:
    work = WeightWork()
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
        linear = _plain_linear(node, weights, saved.get(node, ()))
        if linear is not None:
            work.linears.append(linear)
            continue
        edges = [(GradientEdge(node, k), g) for k, g in enumerate(saved.get(node, ())) if g is not None]
        if edges and weights:
            work.calls.append(([e for e, _ in edges], [g for _, g in edges], weights))
    outside = [(e, g) for (_, g), e in zip(pairs, root_edges) if not graph.to_input[e.node]]
    if outside and graph.root_weights:
        layers = None if any(graph.to_input.values()) else _only_linears(graph)
        if layers:
            work.catches.append(([e for e, _ in outside], [g for _, g in outside], layers))
        else:
            work.calls.append(([e for e, _ in outside], [g for _, g in outside], graph.root_weights))
    return [got.get(id(x)) for x in inputs], work


def _only_linears(graph: _Graph) -> list[_Layer] | None:
    """Every plain linear layer of a graph that touches no input, with its input, weight and bias, if those
    layers' weights and biases are all the graph's leaves and each is reached through its layer only; else None.
    """
    uses: dict[Node, int] = {}
    for node in graph.order:
        for child, _ in node.next_functions:
            if child is not None:
                uses[child] = uses.get(child, 0) + 1
    expected: dict[Node, int] = {}
    found = []
    for node in graph.order:
        leaves = _linear_leaves(node)
        if leaves is None:
            continue
        weight, bias, t_fn, w_acc, b_acc = leaves
        x = node._saved_mat1 if node.name() == "AddmmBackward0" else node._saved_self
        if uses.get(t_fn) != 1 or x is None or x.dim() != 2 or x.dtype != weight.dtype or x.device != weight.device:
            return None
        for acc in (w_acc, b_acc):
            if acc is not None:
                expected[acc] = expected.get(acc, 0) + 1
        found.append((node, x, weight, bias))
    accs = [n for n in graph.order if n.name() == _ACCUMULATE]
    if not found or graph.roots & set(accs) or any(uses.get(a, 0) != expected.get(a, 0) for a in accs):
        return None
    return found


def backward_weight(work: WeightWork) -> None:
    """W: accumulate the weight gradients left by :func:`backward_input` into ``.grad``, freeing the graph."""
    for edges, grads, weights in work.calls:
        torch.autograd.backward(edges, grad_tensors=grads, inputs=weights)
    work.calls.clear()
    for edges, grads, layers in work.catches:  # the gradient at each layer's output, then each layer's W
        caught = torch.autograd.grad(edges, [GradientEdge(n, 0) for n, _, _, _ in layers], grads, allow_unused=True)
        for (_, x, weight, bias), grad in zip(layers, caught):
            if grad is not None:
                work.linears.append((grad, x, weight, bias))
    work.catches.clear()
    with torch.no_grad():
        for grad, x, weight, bias in work.linears:
            if weight.grad is None:
                weight.grad = torch.mm(grad.t(), x)
            else:
                weight.grad.addmm_(grad.t(), x)
            if bias is not None:
                if bias.grad is None:
                    bias.grad = grad.sum(0)
                else:
                    bias.grad.add_(grad.sum(0))
    work.linears.clear()


_LINEAR_NODES = ("AddmmBackward0", "MmBackward0")
_ACCUMULATE = "torch::autograd::AccumulateGrad"


def _linear_leaves(node: Node) -> tuple[torch.Tensor, torch.Tensor | None, Node, Node, Node | None] | None:
    """(weight, bias or None, the transpose's node, the weight's and bias's AccumulateGrad) if ``node`` is a
    linear layer's ``addmm(bias, x, weight.t())`` (alpha = beta = 1) or ``mm(x, weight.t())`` of hookless
    leaves; else None."""
    name = node.name()
    if name not in _LINEAR_NODES:
        return None
    nexts = node.next_functions
    if name == "AddmmBackward0":
        if node._saved_alpha != 1 or node._saved_beta != 1:
            return None
        bias_fn, t_fn = nexts[0][0], nexts[2][0]  # addmm(bias, x, weight.t())
    else:
        bias_fn, t_fn = None, nexts[1][0]  # mm(x, weight.t())
    if t_fn is None or t_fn.name() != "TBackward0":
        return None
    w_acc = t_fn.next_functions[0][0]
    weight = _hookless_leaf(w_acc)
    bias = _hookless_leaf(bias_fn) if bias_fn is not None else None
    if weight is None or weight.dim() != 2 or (bias_fn is not None and bias is None):
        return None
    return weight, bias, t_fn, w_acc, bias_fn


def _linear_parts(node: Node, weights: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(weight, bias or None) if ``node`` is a linear layer (:func:`_linear_leaves`) whose region holds exactly
    that weight and bias; else None."""
    leaves = _linear_leaves(node)
    if leaves is None:
        return None
    weight, bias = leaves[0], leaves[1]
    owned = [weight] if bias is None else [weight, bias]
    if len(weights) != len(owned) or {id(w) for w in weights} != {id(w) for w in owned}:
        return None
    return weight, bias


def _plain_linear(
    node: Node, weights: Sequence[torch.Tensor], grads: tuple[torch.Tensor | None, ...]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """(output gradient, input, weight, bias) for a linear layer W can accumulate itself (:func:`_linear_parts`,
    with 2-D gradient and input of the weight's dtype and device); else None (W goes through the engine)."""
    parts = _linear_parts(node, weights)
    if parts is None or len(grads) != 1 or grads[0] is None:
        return None
    weight, bias = parts
    grad, x = grads[0], node._saved_mat1 if node.name() == "AddmmBackward0" else node._saved_self
    if grad.dim() != 2 or x is None or x.dim() != 2:
        return None
    alike = (t.dtype == weight.dtype and t.device == weight.device and t.layout == torch.strided for t in (grad, x))
    if not all(alike) or (bias is not None and bias.dtype != weight.dtype):
        return None
    return grad, x, weight, bias


def _hookless_leaf(fn: Node) -> torch.Tensor | None:
    """The leaf tensor behind an AccumulateGrad node, if it is a plain tensor or Parameter with no hooks."""
    if fn is None or fn.name() != _ACCUMULATE:
        return None
    leaf: torch.Tensor = fn.variable
    if type(leaf) not in (torch.Tensor, torch.nn.Parameter) or leaf._backward_hooks:
        return None
    if getattr(leaf, "_post_accumulate_grad_hooks", None) or leaf.is_sparse:
        return None
    if leaf.grad is not None and (type(leaf.grad) is not torch.Tensor or not leaf.grad.is_contiguous()):
        return None
    return leaf


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
        order = self.order = _post_order(roots)
        root_set = self.roots = set(roots)
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
