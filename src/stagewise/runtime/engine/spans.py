"""The bytes tensors hold in their storages, each byte once: two views of one storage (a reshape, a
micro-batch of the step's batch) overlap instead of adding up. Used by what W holds
(:meth:`.backward.WeightWork.held_bytes`) and by the memory meter (:mod:`..features.memory`)."""

from __future__ import annotations

from collections.abc import Iterable

import torch


def byte_span(t: torch.Tensor) -> tuple[int, int, int]:
    """(storage, first byte, end byte) that ``t``'s elements span in its storage."""
    size = t.element_size()
    start = int(t.storage_offset()) * size
    extent = 1 + sum((int(n) - 1) * abs(int(st)) for n, st in zip(t.shape, t.stride())) if t.numel() else 0
    return int(t.untyped_storage().data_ptr()), start, start + extent * size


def union_bytes(spans: Iterable[tuple[int, int]]) -> int:
    """The length of a union of byte ranges ``[start, end)``."""
    total, end = 0, -1
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total
