"""Trace a model with torch.fx and give every graph node a pipeline stage.

Rules, applied to the nodes in graph (execution) order:

* a node inside a tagged module takes the tag of the innermost tagged module
  around it (its own module for a leaf call, then the modules fx recorded in
  ``nn_module_stack``, then their parents by qualified name);
* an untagged node follows its inputs: it goes to the latest stage among them;
* model inputs enter at stage 0, so untagged code on them runs on stage 0;
* an untagged node that uses neither model inputs nor computed values (only
  parameters and constants, e.g. ``self.pos * 2``)
  floats: it goes to the earliest stage that uses it;
* a tagged node whose input comes from a later stage is an error that names
  both modules: tags must not go backwards along the data flow.
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import fx, nn

from .tags import tag_of


class SplitError(ValueError):
    """The model cannot be cut as asked; the message says where and why."""


class _Tracer(fx.Tracer):
    def __init__(self, leaves: set[str]) -> None:
        super().__init__()
        self._leaves = leaves

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return module_qualified_name in self._leaves or super().is_leaf_module(m, module_qualified_name)


def tagged_leaves(model: nn.Module, tags: dict[str, int]) -> set[str]:
    """Tagged modules whose whole subtree carries one tag: traced as single calls (fx leaves)."""
    leaves = set()
    for name in tags:
        module = model.get_submodule(name)
        inner = {tag_of(m) for m in module.modules()} - {None}
        if inner == {tags[name]}:
            leaves.add(name)
    return leaves


def trace(model: nn.Module, leaves: set[str], concrete_args: dict[str, Any] | None = None) -> fx.GraphModule:
    """``model`` as an fx GraphModule, with the modules in ``leaves`` kept as opaque calls."""
    tracer = _Tracer(leaves)
    try:
        graph = tracer.trace(model, concrete_args=concrete_args)
    except Exception as e:  # fx raises TraceError, TypeError, RuntimeError... depending on the construct
        raise SplitError(
            f"torch.fx could not trace {type(model).__name__}: {type(e).__name__}: {e}. "
            "Data-dependent control flow, len()/bool() of a tensor or non-torch calls on tensors are not "
            "traceable; tag the module that does it (pipeline_stage) so it is traced as one opaque call, "
            "or pass concrete_args for Python-valued inputs"
        ) from e
    _fixed_defaults(graph, model, concrete_args or {})
    gm = fx.GraphModule(tracer.root, graph, class_name=type(model).__name__)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


def _fixed_defaults(graph: fx.Graph, model: nn.Module, concrete: dict[str, Any]) -> None:
    """Each argument ``concrete_args`` fixes defaults to its fixed value: fx keeps the forward's own default and
    asserts the value passed equals the fixed one, so a step that passed the inputs alone (as a pipeline's does)
    failed that assertion ("mode has been specialized to have value tanh")."""
    names = [n for n in inspect.signature(model.forward).parameters]
    holders = [node for node in graph.nodes if node.op == "placeholder"]
    for name, node in zip(names, holders):
        if name in concrete and not isinstance(concrete[name], fx.PH.__class__):
            node.args = (concrete[name],)


def _innermost_module(node: fx.Node) -> str | None:
    stack = node.meta.get("nn_module_stack") or {}
    names = [qualname for qualname, _ in stack.values()]
    if node.op == "call_module" and (not names or names[-1] != node.target):
        names.append(str(node.target))
    return names[-1] if names else None


def _tag_for(node: fx.Node, tags: dict[str, int]) -> tuple[int, str] | None:
    """The (stage, module) of the innermost tagged module around ``node``, walking up qualified names."""
    name = _innermost_module(node)
    while name:
        if name in tags:
            return tags[name], name
        name = name.rpartition(".")[0]
    return None


def _describe(node: fx.Node, origin: dict[fx.Node, str]) -> str:
    if node in origin:
        return f"module {origin[node]!r} (node {node.name!r})"
    return f"{node.op} {node.name!r}"


def assign_stages(
    graph: fx.Graph, tags: dict[str, int], num_stages: int | None = None, *, placed_by: str = "tagged"
) -> dict[str, int]:
    """Node name -> stage for every computing node (placeholders, get_attr and output excluded).

    ``placed_by`` says in errors where the module stages came from ("tagged", "placed by the partition on").
    """
    level: dict[fx.Node, int] = {n: 0 for n in graph.nodes if n.op == "placeholder"}  # inputs enter at stage 0
    origin: dict[fx.Node, str] = {}  # the tagged module that decided a node's stage
    floating: list[fx.Node] = []
    errors: list[str] = []
    for node in graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        inputs = [a for a in node.all_input_nodes if a in level]
        latest = max(inputs, key=level.__getitem__) if inputs else None
        tag = _tag_for(node, tags)
        if tag is not None:
            level[node], origin[node] = tag
            if latest is not None and level[latest] > level[node]:
                errors.append(
                    f"{_describe(node, origin)} is {placed_by} stage {level[node]} but uses a value from stage "
                    f"{level[latest]}: {_describe(latest, origin)}{_reuse_note(node, graph)}"
                )
        elif latest is not None:
            level[node] = level[latest]
            if latest in origin:
                origin[node] = origin[latest]
        else:
            floating.append(node)
    if errors:
        raise SplitError("stages go backwards along the data flow:\n  " + "\n  ".join(errors))
    stage = {n: k for n, k in level.items() if n.op != "placeholder"}
    last = max(stage.values(), default=0) if num_stages is None else num_stages - 1
    for node in reversed(floating):
        users = [stage[u] for u in node.users if u in stage]
        if any(u.op == "output" for u in node.users):
            users.append(last)
        stage[node] = min(users, default=0)
    p = max(stage.values(), default=0) + 1 if num_stages is None else num_stages
    _check_stages(stage, p, origin)
    return {node.name: k for node, k in stage.items()}


def _reuse_note(node: fx.Node, graph: fx.Graph) -> str:
    if node.op != "call_module":
        return ""
    calls = sum(1 for n in graph.nodes if n.op == "call_module" and n.target == node.target)
    if calls < 2:
        return ""
    return f" ({node.target!r} is called {calls} times; one module cannot run on two stages without tying weights)"


def _check_stages(stage: dict[fx.Node, int], p: int, origin: dict[fx.Node, str]) -> None:
    too_far = sorted({(k, origin.get(n, n.name)) for n, k in stage.items() if k >= p})
    if too_far:
        raise SplitError(f"{p} stages asked for, but tags name stage(s) {too_far}")
    empty = sorted(set(range(p)) - set(stage.values()))
    if empty:
        raise SplitError(
            f"stage(s) {empty} of {p} would compute nothing: no tagged module or code lands there "
            "(tags must use every stage from 0 to the last)"
        )


def first_calls(graph: fx.Graph, names: list[str]) -> list[str]:
    """The modules of ``names`` that the graph calls, in the order of their first call."""
    wanted, order = set(names), []
    for node in graph.nodes:
        if node.op == "call_module" and node.target in wanted and node.target not in order:
            order.append(str(node.target))
    return order
