"""Tied parameters: one module used at several positions of the layer list (embedding <-> LM head).

Roughly (DeepSpeed's ``TiedLayerSpec``, Paddle's ``SharedLayerDesc``): every
:class:`Tied` entry with the same ``key`` shares one module. The first use gives
the layer; later uses may call another function of it::

    layers = [sw.Tied("embed", sw.Layer(nn.Embedding, V, D)), *blocks,
              sw.Tied("embed", forward_fn=lambda emb, h: h @ emb.weight.T)]

* **Built once per rank, identically on every rank**: the module is built
  seeded as its *first* use (``seed + index of the first use``), on every rank
  holding a stage that uses it; two uses on one rank share one module object.
* **Gradients summed over exactly the owning ranks**, once each owning rank has
  run the SYNC of its last stage using the key (an all-reduce started there on
  a process group of the owners, waited for before the optimizer steps or at
  the end of ``train_step``). When every use lives on one rank (the V
  placement puts stage 0 and the last stage together) there is nothing to sum.
* **Named and saved once**: the parameter is registered under its first use's
  name (``"0.weight"``). A rank holding only a later use reports it under that
  same name in ``parameters()`` / ``named_parameters()`` (its optimizer steps
  it, with the same summed gradient, so the copies stay equal), but *not* in
  ``state_dict()``: the union of the ranks' state dicts is the one-process
  model's. :meth:`Pipeline.clip_grad_norm_` counts the parameter once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..comm import collectives, groups
from .layers import Layer, LayerLike, build_stage_layer

if TYPE_CHECKING:
    from ..engine.run import Run

ForwardFn = Callable[..., Any]


class Tied(Layer):
    """A use of the module shared under ``key``; the first use gives ``layer``, later uses may give ``forward_fn``.

    ``forward_fn(module, *inputs)`` replaces ``module(*inputs)`` at this position.
    """

    def __init__(self, key: str, layer: LayerLike | None = None, *, forward_fn: ForwardFn | None = None) -> None:
        if not isinstance(key, str) or not key:
            raise TypeError(f"Tied needs a non-empty string key, got {key!r}")
        if layer is not None and not isinstance(layer, (nn.Module, Layer)) or isinstance(layer, Tied):
            raise TypeError(f"Tied({key!r}) takes an nn.Module or a stagewise.Layer, got {type(layer).__name__}")
        self.key = key
        self.layer = layer
        self.forward_fn = forward_fn
        self.factory, self.args, self.kwargs = type(self), (), {}  # type: ignore[assignment]  # (a spec, not built)

    def build(self, seed: int | None = None) -> nn.Module:
        """The module alone (for parameter counts and profiles); a later use holds no parameters of its own."""
        if self.layer is None:
            return nn.Identity()
        return self.layer.build(seed) if isinstance(self.layer, Layer) else self.layer

    def __repr__(self) -> str:
        fn = "" if self.forward_fn is None else ", forward_fn=..."
        return f"Tied({self.key!r}, {self.layer!r}{fn})"


class TiedCall(nn.Module):
    """A use of a shared module: ``forward_fn(module, *x)``. Only the first use registers the module."""

    def __init__(self, module: nn.Module, forward_fn: ForwardFn | None, registered: bool) -> None:
        super().__init__()
        if registered:
            self.module = module
        else:
            self.__dict__["shared"] = module  # not a child: its parameters are named at the first use
        self.__dict__["forward_fn"] = forward_fn

    @property
    def target(self) -> nn.Module:
        module = self._modules["module"] if "module" in self._modules else self.__dict__["shared"]
        assert isinstance(module, nn.Module)
        return module

    def forward(self, *x: Any) -> Any:
        fn = self.__dict__["forward_fn"]
        return self.target(*x) if fn is None else fn(self.target, *x)


class TiedBuilder:
    """Builds the layers of a model, each tied key's module once (seeded as its first use).

    ``make(layer, index)``: how one layer is made; by default as a stage held here (:func:`.layers.build_stage_layer`
    on ``device``); a profile passes :func:`.layers.build_layer`, as it always builds initialised layers."""

    def __init__(
        self,
        named: Sequence[tuple[str, LayerLike]],
        seed: int,
        device: Any = None,
        *,
        make: Callable[[LayerLike, int], nn.Module] | None = None,
    ) -> None:
        self.seed = seed
        self.device = device
        self._make = make or (lambda layer, index: build_stage_layer(layer, index, self.seed, self.device))
        self.first: dict[str, tuple[int, str, LayerLike]] = {}
        self.uses: dict[str, list[int]] = {}
        for k, (name, layer) in enumerate(named):
            if not isinstance(layer, Tied):
                continue
            self.uses.setdefault(layer.key, []).append(k)
            if layer.key not in self.first:
                if layer.layer is None:
                    raise ValueError(
                        f"layer {name!r} is the first use of tied key {layer.key!r}: it must give the layer"
                    )
                self.first[layer.key] = (k, name, layer.layer)
            elif layer.layer is not None:
                first = self.first[layer.key][1]
                raise ValueError(
                    f"layer {name!r} gives a layer for tied key {layer.key!r}, whose first use (layer {first!r}) "
                    "already did: later uses share it and give at most forward_fn="
                )
        self.built: dict[str, nn.Module] = {}

    def check_plan(self, names: Sequence[str], plan: Mapping[str, Any] | None) -> None:
        """Refuse a tensor-parallel plan that would split a tied module (it must stay whole on every rank).

        Pure in the layers and the plan, so every rank raises alike. ``names``: the layer names.
        """
        if not plan:
            return
        for key, uses in self.uses.items():
            inner = _submodule_names(self.first[key][2])
            for k in uses:
                under = [f"{names[k]}{mid}{sub}" for mid in ("", ".module") for sub in inner]
                hits = sorted({pat for pat in plan for n in under if fnmatchcase(n, pat)})
                if hits:
                    raise ValueError(
                        f"tp_plan keys {hits} split layer {names[k]!r}, a use of tied key {key!r}: tied modules stay "
                        "whole under tensor parallelism (their gradient is summed across stages); leave them out "
                        "of tp_plan"
                    )

    def parameter_ids(self) -> set[int]:
        """ids of the tied parameters already in memory (built, or given as modules): the hybrid axes leave these
        alone, whose gradients :class:`TiedSync` reduces itself over every copy and replica."""
        modules = [*self.built.values(), *(m for _, _, m in self.first.values() if isinstance(m, nn.Module))]
        return {id(p) for m in modules for p in m.parameters()}

    def shared(self, key: str) -> nn.Module:
        if key not in self.built:
            k0, _, spec = self.first[key]
            self.built[key] = self._make(spec, k0)
        return self.built[key]

    def build(self, layer: LayerLike, index: int) -> nn.Module:
        if not isinstance(layer, Tied):
            return self._make(layer, index)
        module = self.shared(layer.key)
        owner = index == self.first[layer.key][0]
        if owner and layer.forward_fn is None:
            return module
        return TiedCall(module, layer.forward_fn, registered=owner)


def _submodule_names(layer: LayerLike) -> list[str]:
    """Name suffixes ("", ".sub", ...) of the layer's module tree (a spec is built on the meta device: no memory)."""
    try:
        if isinstance(layer, Layer):
            with torch.device("meta"):
                layer = layer.build(0)
        return [f".{n}" if n else "" for n, _ in layer.named_modules()]
    except Exception:  # a factory that cannot build on meta: check the layer's own name only
        return [""]


def stage_parameters(modules: Sequence[nn.Module], seen: set[int]) -> list[nn.Parameter]:
    """The trainable parameters a stage's optimizer steps, shared modules included, each once over ``seen``."""
    out = []
    for m in modules:
        params = list(m.parameters())
        if isinstance(m, TiedCall) and "shared" in m.__dict__:
            params += list(m.target.parameters())
        for p in params:
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


class TiedSync:
    """Sums the gradients of each tied module over the ranks owning it, once per step.

    ``stages_of[key]``: the stages using ``key``; ``placement``: stage -> rank.
    The process groups (global ranks of the owners) are made here, in key
    order, by their members only; every rank of the pipeline builds the same
    list, so the calls line up; ``call`` runs each creation within the pipeline's deadline (it blocks until every
    member has joined: a rank that failed before would otherwise hold the others for the backend's timeout). With
    a ``mesh`` a key's group spans its owners
    in every replica (``dp x sharding``) at this rank's ``tp`` coordinate, and
    the sum is divided by the number of replicas.
    """

    def __init__(
        self,
        builder: TiedBuilder,
        ranges: Sequence[range],
        placement: Sequence[int],
        rank: int,
        group: Any,
        wait: Callable[[list[Any], str], None],
        mesh: Any = None,
        call: Callable[[Callable[[], Any], str], Any] | None = None,
    ) -> None:
        self.wait = wait
        call = call or (lambda fn, what: fn())
        self.copies_of: dict[int, int] = {}  # id(param) -> owning ranks
        self.local: dict[str, tuple[nn.Module, set[int]]] = {}  # key -> module, local stages using it
        self.groups: dict[str, Any] = {}
        self.replicas = 1 if mesh is None else mesh.config.replicas
        #: each key's layers (indices into the layer list), for keys used at several: what the cost model's tied sums
        #: price (:mod:`stagewise.planning.tied_sum`)
        self.layer_sets = tuple(tuple(builder.uses[k]) for k in sorted(builder.uses) if len(builder.uses[k]) > 1)
        global_ranks = groups.global_ranks(group)
        world = mesh is not None or len(global_ranks) == groups.world_size()
        for key in sorted(builder.uses):
            stages = {s for s, r in enumerate(ranges) for k in builder.uses[key] if k in r}
            owners = sorted({placement[s] for s in stages})
            every = [[global_ranks[r] for r in owners]] if mesh is None else _replicated(mesh, owners)
            if len(every[0]) > 1:
                made = call(
                    lambda e=every, o=owners: _groups(e, rank in o, world),  # type: ignore[misc]
                    f"the process group of tied key {key!r} (global ranks {every})",
                )
                if rank in owners:
                    self.groups[key] = made
            if rank in owners:
                module = builder.shared(key)
                self.local[key] = (module, {s for s in stages if placement[s] == rank})
                for p in module.parameters():
                    self.copies_of[id(p)] = len(owners)
        self._left: dict[str, set[int]] = {}
        self._pending: dict[str, tuple[Any, torch.Tensor, list[torch.Tensor]]] = {}

    def start_step(self) -> None:
        self._left = {key: set(stages) for key, (_, stages) in self.local.items() if key in self.groups}

    def on_sync(self, run: Run, stage: int) -> None:
        """SYNC of ``stage``: start the reduction of each key whose local stages are all synced (inside a gradient
        merge, none: the copies' gradients accumulate, and the merge's last step sums them once)."""
        if run.accumulate:
            return
        for key, left in self._left.items():
            if stage in left:
                left.discard(stage)
                if not left:
                    self._start(key)

    @torch.no_grad()
    def _start(self, key: str) -> None:
        module = self.local[key][0]
        grads = []
        for p in module.parameters():
            if p.requires_grad:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grads.append(p.grad)
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        self._pending[key] = (collectives.all_reduce_async(flat, self.groups[key]), flat, grads)

    @torch.no_grad()
    def finish(self, stage: int | None = None) -> None:
        """Wait for the reductions touching ``stage`` (all if None; unstarted ones start now) and write them back.
        (Not in a run that only accumulates: :meth:`before_step` and the step's part ask only outside one.)"""
        if stage is None:
            for key, left in self._left.items():
                if left:
                    left.clear()
                    self._start(key)
        keys = [k for k in self._pending if stage is None or stage in self.local[k][1]]
        for key in keys:
            work, flat, grads = self._pending.pop(key)
            self.wait([work], f"the gradient all-reduce of tied key {key!r}")
            if self.replicas > 1:
                flat.div_(self.replicas)
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()

    def before_step(self, run: Run, stage: int) -> None:
        """STEP of ``stage``: its tied gradients must be summed first (none were started in a merge's step)."""
        if not run.accumulate:
            self.finish(stage)

    def params(self) -> set[int]:
        """ids of the tied parameters held here (kept out of sharding and data-parallel buckets)."""
        return set(self.copies_of)

    def copies(self, grad: torch.Tensor, params: Sequence[nn.Parameter]) -> int:
        for p in params:
            if p.grad is grad:
                return self.copies_of.get(id(p), 1)
        return 1


def _replicated(mesh: Any, owners: Sequence[int]) -> list[list[int]]:
    """Global ranks of pipeline ranks ``owners`` in every replica (dp x sharding), one list per tp coordinate;
    this rank's coordinate first."""
    c, mine = mesh.config, mesh.coords.tp
    order = [mine] + [t for t in range(c.tp) if t != mine]
    return [
        sorted(c.rank_of(pp=o, dp=d, sharding=s, tp=t) for o in owners for d in range(c.dp) for s in range(c.sharding))
        for t in order
    ]


def _groups(every: list[list[int]], member: bool, world: bool) -> Any:
    """The tied key's group of this rank (the first of ``every``), made with the process groups alike on every
    rank when the pipeline spans the world (every rank makes every group, in one order: torch's groups made by
    their members only leave the ranks' later groups out of step), else by its members only."""
    if not world:
        return groups.new_subgroup(every[0], member)
    mine = None
    for members in sorted(every):
        made = groups.new_world_subgroup(members)
        if members == every[0]:
            mine = made
    return mine if member else None
