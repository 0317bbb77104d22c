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
    device = _device(group)
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


def gather_bytes_to(
    data: torch.Tensor, sizes: Sequence[int], dst: int, group: Any, wait: Wait | None = None, what: str = "a gather"
) -> list[torch.Tensor] | None:
    """Every rank's 1-d uint8 ``data`` on group rank ``dst`` only (None elsewhere), in group-rank order, on the host:
    one gather, the lengths known to every rank beforehand (``sizes``, by group rank; ``data`` is ``sizes[me]``
    long). Where :func:`gather_bytes` gives every rank every blob, the whole lands on one rank only."""
    device = _device(group)
    me = dist.get_rank(group)
    if data.numel() != sizes[me]:
        raise ValueError(f"{what}: group rank {me} has {data.numel()} bytes to send, {sizes[me]} were agreed")
    padded = torch.zeros(max(max(sizes), 1), dtype=torch.uint8, device=device)
    padded[: data.numel()] = data.to(device)
    out = [torch.empty_like(padded) for _ in sizes] if me == dst else None
    (wait or _plain_wait)([dist.gather(padded, out, dst=_global(group, dst), group=group, async_op=True)], what)
    return None if out is None else [t[:n].cpu() for t, n in zip(out, sizes)]


def _nccl(group: Any) -> bool:
    return str(dist.get_backend(group)) == "nccl"


#: a one-way message's first part, in bytes (:func:`gather_to_first`, :func:`from_first`): what one rank's step
#: of a 10-layer pipeline at 8 micro-batches says takes about 6 KB; a longer message sends the rest apart
FIRST_PART = 1 << 16
_HEAD = 8  # the length, in the first part's first bytes
_REST_TAG = 4917  # the tag of a longer message's rest, sent point to point


def gather_to_first(blob: bytes, group: Any, wait: Wait | None = None, what: str = "a gather") -> list[bytes] | None:
    """Every rank's ``blob`` on the group's first rank, in group-rank order (None on the others), one way: a
    rank sends and goes on, where an all-gather waits for every rank to answer (a rank held by a CPU quota
    answers a period late). A gather of :data:`FIRST_PART` bytes, then, from a rank whose blob is longer, the rest
    point to point."""
    device, wait = _device(group), wait or _plain_wait
    me, size = dist.get_rank(group), dist.get_world_size(group)
    first = _first_part(blob, device)
    parts = [torch.empty_like(first) for _ in range(size)] if me == 0 else None
    works = [dist.gather(first, parts, dst=_global(group, 0), group=group, async_op=True)]
    if len(blob) > FIRST_PART - _HEAD and me != 0:
        rest = _tensor(blob[FIRST_PART - _HEAD :], device)
        works.append(dist.isend(rest, dst=_global(group, 0), group=group, tag=_REST_TAG))
    wait(works, what)
    if parts is None:
        return None
    out = [blob]
    for r, part in enumerate(parts[1:], start=1):
        n = int.from_bytes(_bytes(part[:_HEAD]), "little")
        got = _bytes(part[_HEAD : _HEAD + min(n, FIRST_PART - _HEAD)])
        if n > FIRST_PART - _HEAD:
            tail = torch.empty(n - (FIRST_PART - _HEAD), dtype=torch.uint8, device=device)
            wait([dist.irecv(tail, src=_global(group, r), group=group, tag=_REST_TAG)], f"the rest of {what}")
            got += _bytes(tail)
        out.append(got)
    return out


def from_first(blob: bytes | None, group: Any, wait: Wait | None = None, what: str = "a word") -> bytes:
    """The group's first rank's ``blob`` (given there, None elsewhere) on every rank, one way: a broadcast of
    :data:`FIRST_PART` bytes, and of the rest when the first part's length says it is longer."""
    device, wait = _device(group), wait or _plain_wait
    first = _first_part(blob or b"", device)
    wait([dist.broadcast(first, src=_global(group, 0), group=group, async_op=True)], what)
    n = int.from_bytes(_bytes(first[:_HEAD]), "little")
    got = blob if blob is not None else _bytes(first[_HEAD : _HEAD + min(n, FIRST_PART - _HEAD)])
    if n > FIRST_PART - _HEAD:
        rest = torch.empty(n - (FIRST_PART - _HEAD), dtype=torch.uint8, device=device)
        if blob is not None:
            rest = _tensor(blob[FIRST_PART - _HEAD :], device)
        wait([dist.broadcast(rest, src=_global(group, 0), group=group, async_op=True)], f"the rest of {what}")
        if blob is None:
            got += _bytes(rest)
    return got


def _first_part(blob: bytes, device: torch.device) -> torch.Tensor:
    part = torch.zeros(FIRST_PART, dtype=torch.uint8)
    part[:_HEAD] = torch.frombuffer(bytearray(len(blob).to_bytes(_HEAD, "little")), dtype=torch.uint8)
    body = blob[: FIRST_PART - _HEAD]
    if body:
        part[_HEAD : _HEAD + len(body)] = torch.frombuffer(bytearray(body), dtype=torch.uint8)
    return part.to(device)


def _tensor(blob: bytes, device: torch.device) -> torch.Tensor:
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(device)


def _global(group: Any, rank: int) -> int:
    return dist.get_global_rank(group, rank) if group is not None else rank


def _device(group: Any) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if _nccl(group) else torch.device("cpu")


def _bytes(t: torch.Tensor) -> bytes:
    return bytes(t.cpu().numpy().tobytes())
