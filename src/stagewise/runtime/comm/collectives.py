"""The collectives stagewise issues itself (reductions over mesh axes, gathering small records).

Every one is started asynchronously and waited for through a ``wait(works,
what)`` - the pipeline guard's deadline-bounded wait, which watches the error
board - so no collective of the library outlives the pipeline's ``timeout``
or another rank's failure. Records travel as JSON bytes in uint8 tensors:
nothing a peer sends is unpickled.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}

#: ``wait(works, what)``: block until ``works`` complete, within the deadline (see ``Guard.wait``)
Wait = Callable[[Sequence[Any], str], None]


def _plain_wait(works: Sequence[Any], what: str) -> None:
    for w in works:
        w.wait()


def all_reduce(tensor: torch.Tensor, group: Any, op: str = "sum", wait: Wait | None = None, what: str = "") -> None:
    """Reduce ``tensor`` in place over ``group`` and wait (through ``wait`` when given: deadline and board)."""
    (wait or _plain_wait)([all_reduce_async(tensor, group, op)], what or f"an all-reduce ({op})")


def all_reduce_async(tensor: torch.Tensor, group: Any, op: str = "sum") -> Any:
    """Start reducing ``tensor`` in place over ``group``; returns the work to wait for."""
    if op not in _OPS:
        raise ValueError(f"all_reduce: op must be one of {sorted(_OPS)}, got {op!r}")
    return dist.all_reduce(tensor, _OPS[op], group=group, async_op=True)


def encode(obj: Any) -> bytes:
    """``obj`` as JSON bytes (plain data only: numbers, strings, lists, dicts with string keys)."""
    return json.dumps(obj, separators=(",", ":"), allow_nan=True).encode()


def decode(blob: bytes) -> Any:
    return json.loads(blob.decode())


def gather_json(obj: Any, group: Any, wait: Wait | None = None, what: str = "a gather of records") -> list[Any]:
    """Every rank's ``obj`` (JSON-able), in group-rank order: two all-gathers (lengths, then padded bytes)."""
    blob = encode(obj)
    data = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else torch.zeros(0, dtype=torch.uint8)
    return [decode(bytes(t.numpy().tobytes())) for t in gather_bytes(data, group, wait, what)]


def gather_bytes(
    data: torch.Tensor, group: Any, wait: Wait | None = None, what: str = "a gather of bytes"
) -> list[torch.Tensor]:
    """Every rank's 1-d uint8 ``data`` (any length), in group-rank order, on the host: two all-gathers (lengths,
    then padded bytes)."""
    device = torch.device("cuda", torch.cuda.current_device()) if _nccl(group) else torch.device("cpu")
    size = dist.get_world_size(group)
    length = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    lengths = [torch.empty_like(length) for _ in range(size)]
    (wait or _plain_wait)([dist.all_gather(lengths, length, group=group, async_op=True)], f"the lengths of {what}")
    sizes = [int(t.item()) for t in lengths]
    padded = torch.zeros(max(sizes), dtype=torch.uint8, device=device)
    padded[: data.numel()] = data.to(device)
    out = [torch.empty_like(padded) for _ in range(size)]
    (wait or _plain_wait)([dist.all_gather(out, padded, group=group, async_op=True)], what)
    return [t[:n].cpu() for t, n in zip(out, sizes)]


def _nccl(group: Any) -> bool:
    return str(dist.get_backend(group)) == "nccl"
