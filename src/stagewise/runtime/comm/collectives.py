"""The collectives stagewise issues itself (reductions over mesh axes, gathering small records)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


def all_reduce(tensor: torch.Tensor, group: Any, op: str = "sum") -> None:
    """Reduce ``tensor`` in place over ``group`` and wait."""
    dist.all_reduce(tensor, _OPS[op], group=group)


def all_reduce_async(tensor: torch.Tensor, group: Any, op: str = "sum") -> Any:
    """Start reducing ``tensor`` in place over ``group``; returns the work to wait for."""
    return dist.all_reduce(tensor, _OPS[op], group=group, async_op=True)


def broadcast_async(tensor: torch.Tensor, src: int, group: Any) -> Any:
    """Start sending ``tensor`` from group rank ``src`` to every rank of ``group``; returns the work."""
    return dist.broadcast(tensor, group_src=src, group=group, async_op=True)


def gather_objects(obj: Any, group: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out
