"""Part 4, the move and the last write, one path for a re-layout and a recovery's take-over: every tensor sent
or received in the one global order, then the new stages take their tensors, a kept one by aliasing its old
storage."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import increment_version

from ..checkpoint import state, storage
from ..comm import relayout_wire

#: one tensor's move: its name, the sending and the receiving process, and where the sender reads it (by name)
Move = tuple[str, int, int, Mapping[str, torch.Tensor]]


def post_moves(
    moves: Iterable[Move],
    me: int,
    targets: Mapping[str, torch.Tensor | None],
    described: Callable[[str], Mapping[str, Any]],
    group: Any,
    wait: Callable[[list[Any], str], None],
) -> dict[str, torch.Tensor]:
    """The moves process ``me`` takes part in, in the one order every process walks (so the sends and receives
    pair up), posted together; what it received, by name: into ``targets`` (the new stages' own tensors) where it
    can (:func:`receiver`), else into a new tensor of the shape and dtype ``described(name)`` says."""
    ops: list[tuple[str, torch.Tensor, int]] = []
    got: dict[str, torch.Tensor] = {}
    taken: set[int] = set()
    for name, src, dst, source in moves:
        if src == me:
            ops.append(("send", source[name].detach().cpu().contiguous(), dst))
        elif dst == me:
            got[name] = receiver(targets.get(name), described(name), taken)
            ops.append(("recv", got[name], src))
    relayout_wire.post(ops, group, wait)
    return got


def commit(ranks: storage.Ranks) -> None:
    """The commit point: every process says it filled its new stages; none takes the new layout before all have
    (a failure before it leaves every process with the state from before)."""
    storage.gather(None, ranks, "every process to have filled its new stages")


@torch.no_grad()
def fill(
    new: nn.Module,
    targets: Mapping[str, torch.Tensor | None],
    values: Mapping[str, torch.Tensor],
    record: Mapping[str, Any],
    kept: Mapping[str, torch.Tensor],
) -> None:
    """Write the model tensors, then give the optimizers their state through their own ``load_state_dict``.

    A model tensor this process kept is aliased (the new tensor takes the old one's storage: no copy, no second
    buffer past the release) where dtype, device and shape agree and no other new tensor took that storage.
    Every tensor written counts as written in its version counter, aliased or received in place too: what keeps
    a copy by it sees the change (``offload="optimizer"``'s host masters trained on the values the build had
    given the new stages, silently, before this)."""
    taken: dict[int, int] = {}  # an old storage's address -> the new tensor (id) that took it
    for name, target in targets.items():
        if target is None:
            continue
        value = values[name]
        if name in kept and aliasable(target, value) and taken.setdefault(value.data_ptr(), id(target)) == id(target):
            target.data = value
            increment_version(target)  # (a write autograd does not count: see the docstring)
        elif value.data_ptr() != target.data_ptr():  # (a value received into the target itself is in place)
            target.copy_(value)
        else:
            increment_version(target)  # (received in place: not counted either)
    optimizers = state.optimizers_of(new, None)
    if optimizers:
        tensors = {n: v for n, v in values.items() if n.startswith(state.OPTIM)}
        state.restore_optimizers(optimizers, state.parameter_names(new), {"optimizer": record}, tensors)


def aliasable(target: torch.Tensor, value: torch.Tensor) -> bool:
    """Plain tensors of one dtype, device and shape (a DTensor or other subclass is copied)."""
    same = (target.dtype, target.device, target.shape) == (value.dtype, value.device, value.shape)
    return same and type(target.data) is torch.Tensor and type(value) is torch.Tensor


def receiver(target: torch.Tensor | None, described: Mapping[str, Any], taken: set[int]) -> torch.Tensor:
    """Where a moved tensor is received: into the new stage's own tensor where it is a plain contiguous CPU tensor
    of the listed shape and dtype that no other receive writes (so no second buffer is held until the fill copies
    it), else into a new tensor (an optimizer's state, a tensor sharing its storage)."""
    shape, dtype = list(described["shape"]), getattr(torch, described["dtype"])
    if target is not None and type(target.data) is torch.Tensor and target.device.type == "cpu":
        if list(target.shape) == shape and target.dtype == dtype and target.is_contiguous():
            if target.data_ptr() not in taken:
                taken.add(target.data_ptr())
                return target.detach()
    return torch.empty(shape, dtype=dtype)
