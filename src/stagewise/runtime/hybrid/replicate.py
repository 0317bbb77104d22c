"""The replicas of a rank's stages made equal at construction: the first replica's weights handed to the others."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from .hybrid import Hybrid


@torch.no_grad()
def replicate_first(hybrid: Hybrid, modules: dict[int, list[nn.Module]], wait: Any) -> None:
    """Make every replica of this rank's stages (over the dp, sharding and tp axes) hold the first one's values.

    A model built by the user on every rank need not be built alike (no seed, or a seed per rank); data
    parallelism averages gradients and would train different replicas forever after, and tensor
    parallelism splits each rank's own copy. So, as torch's DistributedDataParallel does at construction,
    the first replica's parameters and buffers are handed to the others: a sum where every other replica
    adds zeros, exact in any order.
    """
    config = hybrid.config
    axes = tuple(a for a in ("dp", "sharding", "tp") if config.size(a) > 1)
    if not axes:
        return
    first = all(getattr(hybrid.mesh.coords, a) == 0 for a in axes)
    tensors: dict[int, torch.Tensor] = {}
    for mods in modules.values():
        for module in mods:
            for t in [*module.parameters(), *module.buffers()]:
                if not t.is_meta:
                    tensors.setdefault(id(t), t)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors.values():
        by_dtype.setdefault(t.dtype, []).append(t)
    for dtype, same in by_dtype.items():  # one reduction per dtype, not per tensor
        wire = torch.uint8 if dtype is torch.bool else dtype  # (gloo sums no bools)
        if first:
            flat = torch.cat([t.detach().reshape(-1) for t in same]).to(wire)
        else:
            flat = torch.zeros(sum(t.numel() for t in same), dtype=wire, device=same[0].device)
        hybrid.mesh.all_reduce(flat, axes, wait=wait, what=f"the first replica's {dtype} weights")
        flat = flat.to(dtype)
        at = 0
        for t in same:
            t.copy_(flat[at : at + t.numel()].view_as(t))
            at += t.numel()
