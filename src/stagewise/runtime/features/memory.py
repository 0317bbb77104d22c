"""Activation memory as the runtime holds it: bytes saved for backward, alive at once, per rank.

Roughly: while a step runs under :class:`ActivationMeter`, every tensor autograd
saves for a backward passes through ``torch.autograd.graph.saved_tensors_hooks``;
the meter counts the bytes of storage it spans, each byte once however many views
of it are saved (a tensor saved by two nodes, or saved once as it is and once
reshaped - attention's output in a GPT block - counts once), parameters excluded,
and uncounts them when autograd frees the last node holding them (after the micro-batch's B, or its I on a zero-bubble
schedule: I frees the graph as it goes). What I leaves for W - the deferred ops'
inputs and output gradients, :meth:`~..engine.backward.WeightWork.held_bytes`,
each stashed byte once - the interpreter charges with :meth:`hold` when I ends
and takes back with :meth:`drop` when W ends. ``peak`` is the most bytes alive
at once during the step, the quantity the simulator's ``peak_activation_bytes``
predicts; ``by_forward[(stage, microbatch)]`` the bytes each F added, which is
what a :class:`~stagewise.CostModel` takes as a stage's ``activation_bytes``;
``by_weight[(stage, microbatch)]`` the bytes its I left for W (its
``weight_activation_bytes``; 0 if W needs nothing).

The pack hook keeps a *detached* view: a saved output holds its own
``grad_fn``, so keeping the tensor itself would make a cycle (node -> saved
variable -> hook object -> tensor -> node) that no garbage collector sees.

A checkpointed segment (:mod:`.recompute`) saves only its inputs through these
hooks; what its recompute materialises during the backward is held by
``torch.utils.checkpoint`` itself and is not counted.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch

from ...ir import Kind
from ..engine.spans import byte_span, union_bytes

if TYPE_CHECKING:
    from ..engine.run import Run

Key = tuple[int, int, int]  # (storage, first byte, end byte): engine.spans.byte_span


def _local(t: torch.Tensor) -> torch.Tensor | None:
    """What ``t`` holds in this rank's memory: a DTensor's local shard (a sharded parameter, or an activation a
    tensor-parallel layer saves for its backward), else ``t``; None if it has no storage (a parameter FSDP2 has
    freed or not materialised)."""
    if hasattr(t, "to_local"):
        with torch.no_grad():
            t = t.to_local()
    try:
        t.untyped_storage().data_ptr()
    except RuntimeError:
        return None
    return t


def _storage_ptr(p: torch.Tensor) -> int | None:
    """Where a parameter's values live (:func:`_local`)."""
    local = _local(p)
    return None if local is None else int(local.untyped_storage().data_ptr())


class _Held:
    __slots__ = ("key", "meter", "tensor")

    def __init__(self, meter: ActivationMeter, key: Key, tensor: torch.Tensor) -> None:
        self.meter, self.key, self.tensor = meter, key, tensor

    def __del__(self) -> None:
        self.meter._release(self.key)


class ActivationMeter:
    """Counts the bytes saved for backward during a step; the running action is named by ``run`` (the run value,
    set while a pipeline's train step runs), or else by ``where()`` (a meter used alone: profiling, tests)."""

    def __init__(self, params: Iterable[torch.Tensor], where: Callable[[], Any] | None = None) -> None:
        self.param_storages = {ptr for p in params if (ptr := _storage_ptr(p)) is not None}
        self.run: Run | None = None
        self.where = where
        self.live: dict[Key, int] = {}  # a saved span -> how many saved tensors hold it
        self.spans: dict[int, set[tuple[int, int]]] = {}  # storage -> its live spans
        self.counted: dict[int, int] = {}  # storage -> the bytes counted for it (the union of its spans)
        self.current = 0
        self.peak = 0
        self.by_forward: dict[tuple[int, int], int] = {}
        self.by_weight: dict[tuple[int, int], int] = {}
        self._held: dict[tuple[int, int], int] = {}  # bytes I left for W, per (stage, micro-batch)

    def reset(self) -> None:
        self.peak = self.current
        self.by_forward = {}
        self.by_weight = {}

    def hooks(self) -> Any:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def _pack(self, t: torch.Tensor) -> Any:
        if isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter) or t.device.type == "meta":
            return t  # a parameter, or a view of one (FSDP2 gathers whole parameters into fresh storage each step)
        local = _local(t)  # (a DTensor holds no storage of its own: its shard is what this rank keeps)
        if local is None or local.untyped_storage().data_ptr() in self.param_storages or local.numel() == 0:
            return t
        key = byte_span(local)
        held = self.live.get(key, 0)
        self.live[key] = held + 1
        if held == 0:
            self.spans.setdefault(key[0], set()).add(key[1:])
            nbytes = self._recount(key[0])
            action = self.run.current if self.run is not None else self.where() if self.where is not None else None
            if action is not None and action.kind is Kind.F and action.microbatch is not None:
                at = (action.stage, action.microbatch)
                self.by_forward[at] = self.by_forward.get(at, 0) + nbytes
        return _Held(self, key, t.detach())

    def _release(self, key: Key) -> None:
        held = self.live.get(key)
        if held is None:
            return
        if held > 1:
            self.live[key] = held - 1
            return
        del self.live[key]
        self.spans[key[0]].discard(key[1:])
        self._recount(key[0])

    def _recount(self, storage: int) -> int:
        """Count ``storage``'s saved bytes again (the union of its live spans); the change, in bytes."""
        spans = self.spans.get(storage, set())
        now = union_bytes(spans)
        change = now - self.counted.get(storage, 0)
        if spans:
            self.counted[storage] = now
        else:
            self.counted.pop(storage, None)
            self.spans.pop(storage, None)
        self.current += change
        self.peak = max(self.peak, self.current)
        return change

    def hold(self, at: tuple[int, int], nbytes: int) -> None:
        """The I of ``at`` = (stage, micro-batch) left ``nbytes`` for its W (charged until :meth:`drop`)."""
        self._held[at] = self._held.get(at, 0) + nbytes
        self.by_weight[at] = nbytes
        self.current += nbytes
        self.peak = max(self.peak, self.current)

    def drop(self, at: tuple[int, int]) -> None:
        """The W of ``at`` ran: what its I left is free."""
        self.current -= self._held.pop(at, 0)


def _unpack(held: Any) -> torch.Tensor:
    return held.tensor if isinstance(held, _Held) else held
