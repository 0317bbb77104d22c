"""A model built whole by the user (``from_model``, ``from_hf``) laid out again without its freed parts.

With ``free_unused`` (the default) each rank keeps only its stages' tensors; the others are on ``meta``. A
re-layout needs the model's *structure* (to trace and cut it again, or to find its decoder layers), not its
values: those come from the processes that hold them. So the new stages are built from :func:`meta_twin`, a
copy of the model whose tensors are all on ``meta`` (no memory), and :func:`given_storage` gives the held
ones zeroed storage (no initialisation computed), which the re-layout fills (:mod:`stagewise.runtime.relayout.fill`).
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Iterable
from itertools import chain
from typing import Any

import torch
from torch import nn

from .layers import building_empty


def meta_twin(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are on ``meta`` (a tensor several modules share stays
    shared, so ties hold). A non-persistent buffer is copied as it is (no state moves it); the hooks stagewise
    put on the model's modules (dropout, BatchNorm) are left behind: the new pipeline puts its own."""
    memo: dict[int, Any] = {}
    for m in model.modules():
        for name, t in chain(m._parameters.items(), m._buffers.items()):
            if t is None or id(t) in memo:
                continue
            if name in m._non_persistent_buffers_set and not t.is_meta:
                memo[id(t)] = t.detach().clone()
            else:
                meta = t.detach().to("meta")
                memo[id(t)] = nn.Parameter(meta, t.requires_grad) if isinstance(t, nn.Parameter) else meta
        for attr, hooks in vars(m).items():
            if attr.endswith("hooks") and isinstance(hooks, dict) and id(hooks) not in memo:
                memo[id(hooks)] = OrderedDict((k, h) for k, h in hooks.items() if not _ours(h))
    return copy.deepcopy(model, memo)


def _ours(hook: Any) -> bool:
    owner = getattr(hook, "__self__", None)
    where = type(owner).__module__ if owner is not None else getattr(hook, "__module__", None) or ""
    return where.split(".")[0] == "stagewise"


def given_storage(held: Iterable[nn.Module], model: nn.Module, device: Any) -> None:
    """Inside :func:`~.layers.built_empty`: every ``meta`` tensor of the ``held`` modules gets zeroed
    storage on ``device``, in every module of ``held`` and ``model`` holding it (a tie stays one tensor).
    A non-persistent buffer left on ``meta`` (freed here, and no state moves it) is refused."""
    if not building_empty():
        return
    held = list(held)
    made: dict[int, torch.Tensor] = {}
    for m in chain.from_iterable(h.modules() for h in held):
        for name, t in chain(m._parameters.items(), m._buffers.items()):
            if t is None or not t.is_meta or id(t) in made:
                continue
            if name in m._non_persistent_buffers_set:
                raise ValueError(
                    f"the non-persistent buffer {name!r} of a {type(m).__name__} was freed on this process and no "
                    "state carries it: build the model with free_unused=False to re-layout it"
                )
            empty = torch.zeros_like(t, device=device if device is not None else "cpu")  # (never garbage)
            made[id(t)] = nn.Parameter(empty, t.requires_grad) if isinstance(t, nn.Parameter) else empty
    for m in chain(chain.from_iterable(h.modules() for h in held), model.modules()):
        for store in (m._parameters, m._buffers):
            for name, t in list(store.items()):
                if t is not None and id(t) in made:
                    store[name] = made[id(t)]  # type: ignore[assignment]  # (buffers' dict holds plain tensors)
