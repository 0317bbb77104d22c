"""Part 3's loan: a layer this process holds in both layouts takes its old tensors' storage as it is built.

Built empty (:func:`~stagewise.runtime.frontends.layers.built_empty`), a new stage would allocate every tensor
and the fill would then alias a kept one to its old storage, letting the new allocation go: each kept tensor was
held twice until then (measured: a third of the state on a process whose layers stay). Lent at the build, a kept
tensor goes from ``meta`` to its old storage and is never allocated again. Only a layer list's layers are lent (a
layer's one-process name is its name in the list); a model cut by ``from_model`` / ``from_hf`` is built empty and
aliased at the fill, as before.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from ..frontends.layer_list import LayerList
from ..frontends.layers import Lend
from ..frontends.parts import Frontend
from ..frontends.plan import FromPlan


def lender(old: nn.Module | None, frontend: Frontend) -> Lend | None:
    """``lend(index)`` for the new layout's build: the tensors the old layout holds here for layer ``index`` of
    ``frontend`` (the new layout's way in), by name within the layer; None when nothing can be lent."""
    layers = frontend.layers if isinstance(frontend, FromPlan) else frontend
    if old is None or not isinstance(layers, LayerList):
        return None
    names = [name for name, _ in layers.named]
    held = dict(old.named_children())  # the old layout's layers here, by their one-process names

    def lend(index: int) -> Mapping[str, torch.Tensor]:
        module = held.get(names[index]) if 0 <= index < len(names) else None
        if module is None:
            return {}
        return {name: t.detach() for name, t in module.state_dict(keep_vars=True).items()}

    return lend
