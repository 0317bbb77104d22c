"""Tied parameters found in a model (not declared with :class:`~stagewise.Tied`), synced as Tied keys are.

``from_model`` finds a parameter used on several stages (``head.weight = embed.weight``, or the model's own forward
computing ``h @ self.embed.weight.T``; a block reaching it outside its module tree is refused: :mod:`.unheld`). Each
becomes one key of :class:`.tied.TiedSync`: every rank owning a stage that uses it holds the parameter, and their
gradients are summed at the SYNC of the last stage using it there, before any optimizer steps. Each name is saved
once: a name (``embed.weight``) that stages on two ranks register is left out of ``state_dict()`` everywhere but on
the first such stage's rank; a different name of the same parameter (``head.weight``) is saved where it is held, as
``model.state_dict()`` has both.

:func:`tied_layers`: the same ties among a profile's layers (declared :class:`~stagewise.Tied` uses, found
ones and a transformers model's tied embedding alike), which ``stagewise.profile`` records for the planner
(``LayerProfile.tied``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from torch import nn

from .tied import TiedBuilder, TiedCall


class FoundTies(TiedBuilder):
    """Tied parameters of a model as TiedSync keys: ``uses[name]`` are unit indices (one per stage using it)."""

    def __init__(
        self, uses: Mapping[str, list[int]], holder: Callable[[str], nn.Module], param: Callable[[str], nn.Parameter]
    ) -> None:
        super().__init__([], 0)
        self.uses = dict(uses)
        self._holder = holder
        self._param = param

    def parameter_ids(self) -> set[int]:
        """ids of the tied parameters (by their names in the model: no holder is made before the sync asks)."""
        return {id(self._param(name)) for name in self.uses}

    def shared(self, key: str) -> nn.Module:
        """A module whose one parameter is the tied one (made only on ranks that own it)."""
        if key not in self.built:
            self.built[key] = self._holder(key)
        return self.built[key]


def found_ties(model: nn.Module, uses: Mapping[str, Sequence[int]]) -> FoundTies | None:
    """``uses``: first name -> the unit (an index into the layer ranges) standing for each stage using it."""
    if not uses:
        return None

    def holder(name: str) -> nn.Module:
        box = nn.Module()
        box.register_parameter("weight", model.get_parameter(name))
        return box

    return FoundTies({name: list(units) for name, units in uses.items()}, holder, model.get_parameter)


def tie_aliases(held: Iterable[nn.Module], ties: Iterable[str], model: nn.Module) -> dict[str, str]:
    """The names this rank holds a tied parameter under when it does not hold it under its first name
    (``head.weight`` without ``embed.weight``), each -> that first name: ``Pipeline.named_parameters`` lists it
    so, as one process lists a tied parameter once under its first name, and its optimizer state is saved and
    found under that name on every rank and under every layout (:mod:`..checkpoint.state`)."""
    out: dict[str, str] = {}
    for first in ties:
        param = model.get_parameter(first)
        names = [n for m in held for n, p in m.named_parameters(remove_duplicate=False) if p is param]
        if names and first not in names:
            out.update(dict.fromkeys(names, first))
    return out


def unsaved_names(
    stage_modules: Sequence[nn.Module],
    ties: Mapping[str, Sequence[int]],
    placement: Sequence[int],
    rank: int,
    model: nn.Module,
) -> set[str]:
    """Names of tied parameters this rank holds but must not save: an earlier stage on another rank saves them."""
    skip: set[str] = set()
    for name, stages in ties.items():
        param = model.get_parameter(name)
        first_holder: dict[str, int] = {}
        for k in sorted(stages):
            for n, p in stage_modules[k].named_parameters(remove_duplicate=False):
                if p is param:
                    first_holder.setdefault(n, k)
        for k in stages:
            if placement[k] != rank:
                continue
            for n, p in stage_modules[k].named_parameters(remove_duplicate=False):
                if p is param and placement[first_holder[n]] != rank:
                    skip.add(n)
    return skip


def save_once(root: nn.Module, skip: set[str]) -> None:
    """Leave ``skip`` out of ``root.state_dict()``, and do not ask for them in ``load_state_dict``."""
    if not skip:
        return

    def drop(module: nn.Module, state: dict[str, Any], prefix: str, metadata: Any) -> None:
        for name in skip:
            state.pop(prefix + name, None)

    def allow_missing(module: nn.Module, incompatible: Any) -> None:
        for name in skip:
            if name in incompatible.missing_keys:
                incompatible.missing_keys.remove(name)

    root.register_state_dict_post_hook(drop)
    root.register_load_state_dict_post_hook(allow_missing)


def tied_layers(modules: Sequence[nn.Module]) -> tuple[tuple[tuple[int, ...], float], ...]:
    """The sets of ``modules`` (a profile's layers, in its order) that use one trainable parameter, each with the
    bytes of the parameters its layers share (each once): ``LayerProfile.tied``. A layer uses its own parameters
    and those of the shared module of every :class:`~.tied.TiedCall` in it (a later ``sw.Tied`` use registers
    none); layers sharing any parameter are one set, as the runtime sums them in one group."""
    users: dict[int, list[int]] = {}
    size: dict[int, int] = {}
    for k, module in enumerate(modules):
        called = [m.target for m in module.modules() if isinstance(m, TiedCall)]
        for p in (p for m in (module, *called) for p in m.parameters()):
            if p.requires_grad and k not in users.setdefault(id(p), []):
                users[id(p)].append(k)
                size[id(p)] = p.numel() * p.element_size()
    root = list(range(len(modules)))

    def find(k: int) -> int:
        while root[k] != k:
            k = root[k]
        return k

    for ks in users.values():
        for k in ks[1:]:
            root[find(k)] = find(ks[0])
    sets: dict[int, tuple[set[int], float]] = {}
    for key, ks in users.items():
        if len(ks) > 1:
            layers, nbytes = sets.get(find(ks[0]), (set(), 0.0))
            sets[find(ks[0])] = (layers | set(ks), nbytes + size[key])
    return tuple(sorted((tuple(sorted(layers)), nbytes) for layers, nbytes in sets.values()))
