"""The peak of live tensor bytes over a block of code (not RSS): what a re-layout costs in memory on a process.

A dispatch mode sees every tensor an operator returns on this thread and tracks its storage (by a weak
reference to the storage, so views and aliases count once and a storage counts until its last user lets it go);
the tensors held before the block are tracked too (:meth:`LiveBytes.hold`), so their release counts. After every
operator the live total is summed: its peak above the bytes held at the start is the block's extra memory. Exact
for storages at operator boundaries, the same on every run; bytes a kernel allocates and frees inside one operator,
or that a backend allocates outside torch's tensors (gloo's own buffers, pickled objects), are not tensors and not
counted. CPU's allocator keeps no running total, and the profiler's memory events lose the frees of blocks
allocated before it started (their size is unknown to it), the old layout's release among them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    """``with LiveBytes().hold(tensors) as live: ...``; then ``live.extra``: the peak above the start, in bytes."""

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}  # storage address -> (weak ref, bytes)
        self._made: dict[int, str] = {}  # storage address -> the operator that made it (inside the block)
        self.start = 0
        self.peak = 0
        self.at_peak: list[tuple[int, str]] = []  # (bytes, operator) of the storages made here alive at the peak

    def hold(self, tensors: Iterable[torch.Tensor]) -> LiveBytes:
        """Track tensors held before the block (the state the block may release); call before entering."""
        for t in tensors:
            self._track(t)
        self.start = self.peak = self.now()
        return self

    @property
    def extra(self) -> int:
        """The peak of live tensor bytes above those held at the start."""
        return self.peak - self.start

    def now(self) -> int:
        """The live bytes of the tracked storages (those let go are dropped)."""
        gone = [key for key, (ref, _) in self._live.items() if ref.expired()]
        for key in gone:
            del self._live[key]
            self._made.pop(key, None)
        return sum(size for _, size in self._live.values())

    def _track(self, t: Any, op: str = "") -> None:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a wrapper subclass without storage of its own
            return
        key = storage.data_ptr()
        if key == 0 or storage.nbytes() == 0:
            return
        if op and key not in self._live:
            self._made[key] = op
        self._live[key] = (StorageWeakRef(storage), storage.nbytes())  # a resized storage: its new size

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            self._track(t, str(func))
        now = self.now()
        if now > self.peak:
            self.peak = now
            made = [(size, self._made[key]) for key, (_, size) in self._live.items() if key in self._made]
            self.at_peak = sorted(made, reverse=True)
        return out


def state_tensors(pipe: Any) -> list[torch.Tensor]:
    """What a pipeline holds on this process: parameters (and their gradients), buffers, its optimizers' state."""
    out: list[torch.Tensor] = [*pipe.parameters(), *pipe.buffers()]
    out += [p.grad for p in pipe.parameters() if p.grad is not None]
    for opt in (getattr(pipe, "optimizers", None) or {}).values():
        out += [v for entries in opt.state.values() for v in entries.values() if isinstance(v, torch.Tensor)]
    return out


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """The bytes of the distinct storages under ``tensors`` (a tied or aliased tensor counts once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t.device.type != "meta":
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())
