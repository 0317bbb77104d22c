"""Cut a traced model into stage modules with ``torch.fx.passes.split_module``, then make each a pipeline stage.

``split_module`` groups the nodes by stage and works out which values each
group needs from outside. A pipeline needs three more things, added here:

* **pass-through**: stage k receives only from stage k-1, so a value made on
  stage i and used on stage j > i + 1 (a residual, a mask, a model input) is
  returned by every stage in between. Stage k's inputs are exactly the values
  made before k and used at k or later; its outputs are stage k+1's inputs;
  the last stage returns the model's output;
* **parameter ownership**: ``split_module`` passes parameters read with
  ``self.weight`` in as arguments; a stage owns them instead (a get_attr);
* **original names**: modules and parameters keep their qualified names
  (``blocks.3.attn.weight``), so a stage's ``state_dict`` is a slice of the
  model's.

Stage modules share their modules and parameters with the model (no copies).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

from torch import fx, nn
from torch.fx.passes.split_module import split_module

from .trace import SplitError


def liveness(graph: fx.Graph, stage_of: dict[str, int], num_stages: int) -> list[tuple[str, ...]]:
    """Stage k's inputs by node name: stage 0 the model's inputs, stage k what is made before k, used from k on."""
    made: dict[str, int] = {}
    last_use: dict[str, int] = {}
    order: list[str] = []
    for node in graph.nodes:
        if node.op == "placeholder":
            made[node.name] = -1
            order.append(node.name)
        elif node.name in stage_of:
            made[node.name] = stage_of[node.name]
            order.append(node.name)
        if node.op == "get_attr":
            continue
        user = num_stages - 1 if node.op == "output" else stage_of.get(node.name)
        if user is None:
            continue
        for arg in node.all_input_nodes:
            if arg.name in made:
                last_use[arg.name] = max(last_use.get(arg.name, -1), user)
    live = [tuple(n for n in order if made[n] == -1)]
    for k in range(1, num_stages):
        live.append(tuple(n for n in order if made[n] < k <= last_use.get(n, -1)))
    return live


def _attr(root: nn.Module, qualname: str) -> Any:
    value: Any = root
    for atom in qualname.split("."):
        value = getattr(value, atom)
    return value


def cut(
    gm: fx.GraphModule, model: nn.Module, stage_of: dict[str, int], num_stages: int
) -> tuple[list[fx.GraphModule], list[tuple[str, ...]]]:
    """The stage modules of ``gm`` (traced from ``model``) cut by ``stage_of``, and each stage's input names."""
    qualnames: dict[str, str] = {}
    parts = split_module(gm, model, lambda n: stage_of[n.name], qualname_map=qualnames, keep_original_node_name=True)
    live = liveness(gm.graph, stage_of, num_stages)
    stages = []
    for k in range(num_stages):
        builder = _StageBuilder(gm, k, live[k])
        builder.copy(getattr(parts, f"submod_{k}"), qualnames)
        stages.append(builder.finish(live[k + 1] if k + 1 < num_stages else None))
    return stages, live


class _StageBuilder:
    """Builds stage k's graph: its inputs, the nodes ``split_module`` gave it (original names), its outputs."""

    def __init__(self, gm: fx.GraphModule, k: int, inputs: tuple[str, ...]) -> None:
        self.gm, self.k = gm, k
        self.originals = {node.name: node for node in gm.graph.nodes}
        self.graph = fx.Graph()
        self.env: dict[str, fx.Node] = {}
        self.owned: dict[str, Any] = {}  # qualified name -> module / parameter / buffer the stage holds
        for name in inputs:
            source = self.originals[name]
            default = source.args[0] if k == 0 and source.args else inspect.Signature.empty
            self.env[name] = self.graph.placeholder(name, default_value=default)

    def get_attr(self, target: str) -> fx.Node:
        if target not in self.owned:
            self.owned[target] = _attr(self.gm, target)
        return self.graph.get_attr(target)

    def copy(self, body: fx.GraphModule, qualnames: dict[str, str]) -> None:
        for node in body.graph.nodes:
            if node.op == "placeholder":
                source = self.originals[node.name]
                if source.op == "get_attr":  # split_module passes parameters in; the stage owns them instead
                    self.env[node.name] = self.get_attr(str(source.target))
            elif node.op == "get_attr":
                self.env[node.name] = self.get_attr(str(node.target))
            elif node.op != "output":
                new = self.graph.node_copy(node, lambda n: self.env[n.name])
                if node.op == "call_module":  # split_module renamed "blocks.3" to "blocks_3": restore it
                    new.target = qualnames[f"submod_{self.k}.{node.target}"]
                    self.owned[new.target] = self.gm.get_submodule(new.target)
                self.env[node.name] = new

    def finish(self, outputs: tuple[str, ...] | None) -> fx.GraphModule:
        """Return ``outputs`` as a tuple, or (None: the last stage) the model's own output."""
        if outputs is not None:
            self.graph.output(tuple(self.env[name] for name in outputs))
        else:
            result = next(n for n in self.gm.graph.nodes if n.op == "output").args[0]
            self.graph.output(fx.graph.map_arg(result, self._value))
        return fx.GraphModule(self.owned, self.graph, class_name=f"Stage{self.k}")

    def _value(self, n: fx.Node) -> fx.Node:
        return self.get_attr(str(n.target)) if n.op == "get_attr" else self.env[n.name]


def shared_parameters(model: nn.Module, stages: Sequence[nn.Module]) -> dict[str, tuple[int, ...]]:
    """Parameters used on several stages (tied weights): the model's first name for each -> the stages using it.

    A pipeline keeps one copy per owning rank and sums their gradients (as for :class:`~stagewise.Tied`).
    """
    names: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    users: dict[int, list[int]] = {}
    for k, stage in enumerate(stages):
        for p in stage.parameters():
            users.setdefault(id(p), []).append(k)
    unnamed = [ks for pid, ks in users.items() if len(ks) > 1 and pid not in names]
    if unnamed:
        raise SplitError(f"a parameter that is not the model's own is used on stages {unnamed[0]}")
    return {names[pid]: tuple(ks) for pid, ks in users.items() if len(ks) > 1}
