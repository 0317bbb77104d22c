"""The snapshots' traffic (:mod:`stagewise.runtime.elastic`): a gloo group of its own, and bytes between two ranks.

The copies to the peers run on a helper thread while the pipeline trains, so they get their own process
group (gloo, host memory: on GPUs too the copy is taken to the host first), never the pipeline's. Every
exchange sends a length first (-1: nothing to send), then the bytes; every wait has a deadline, so a peer
that is gone costs the timeout at most, and raises.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..errors import PipelineError
from . import groups
from .collectives import gather_json

#: a side exchange's deadline may not outlast the pipeline's own (seconds)
_NOTHING = -1


def snapshot_group(group: Any, timeout: float) -> Any:
    """A gloo group of ``group``'s ranks (None: the world). ``dist.new_group`` is called by every process of the
    world, in one order (a group made by its members alone is named by a count each process keeps, which other
    groups made that way can put out of step): when the pipeline is not the whole world, every rank's pipeline
    group is gathered first and each made in turn, as every rank builds its pipeline at the same time."""
    mine = tuple(groups.global_ranks(group))
    delta = timedelta(seconds=timeout)
    if len(mine) == groups.world_size():
        return dist.new_group(list(mine), backend="gloo", timeout=delta)
    everyone = gather_json(list(mine), None, _deadline(timeout), "every rank's pipeline group (snapshot=)")
    found = None
    for ranks in sorted({tuple(r) for r in everyone}):
        made = dist.new_group(list(ranks), backend="gloo", timeout=delta)
        if ranks == mine:
            found = made
    return found


def gather(obj: Any, group: Any, timeout: float, what: str) -> list[Any]:
    """Every rank's JSON-like ``obj`` over ``group``, in group-rank order, within ``timeout`` seconds."""
    return gather_json(obj, group, _deadline(timeout), what)


def exchange(
    payload: torch.Tensor | None,
    dest: int | None,
    sources: Sequence[int],
    group: Any,
    timeout: float,
    into: dict[int, torch.Tensor] | None = None,
) -> dict[int, torch.Tensor | None]:
    """Send ``payload`` (uint8, host) to group rank ``dest`` while receiving one from each of ``sources``;
    what each source sent (None when it had nothing). Lengths first, then the bytes. ``into``: by source, a
    buffer to receive into, kept from call to call (a new one's pages cost as much as the bytes' copy).

    Every transfer is waited for, and the first failure raised after them all: a source that is gone does not
    stop the copy to ``dest``. Otherwise the survivor after a lost machine in the ring gives up at once, and
    the one after it waits the whole timeout for bytes that never come - and its recovery with it. The
    ``timeout`` bounds the whole exchange (a stopped peer costs it once, not once per transfer)."""
    end, failed = time.monotonic() + timeout, list[PipelineError]()
    mine = torch.tensor([_NOTHING if payload is None else payload.numel()], dtype=torch.int64)
    lengths = {s: torch.empty(1, dtype=torch.int64) for s in sources}
    works = {s: dist.irecv(t, group_src=s, group=group) for s, t in lengths.items()}
    send = dist.isend(mine, group_dst=dest, group=group) if dest is not None else None
    what = "the lengths of the snapshots' copies"
    arrived = [s for s, w in works.items() if _settled(w, end, what, failed)]
    sent = send is not None and _settled(send, end, what, failed)
    keep: dict[int, torch.Tensor] = {} if into is None else into
    buffers = {s: _buffer(keep, s, int(lengths[s].item())) for s in arrived if int(lengths[s].item()) > 0}
    works = {s: dist.irecv(buffers[s], group_src=s, group=group) for s in buffers}
    if sent and payload is not None and payload.numel():
        works[-1] = dist.isend(payload, group_dst=dest, group=group)
    what = "the snapshots' copies"
    got = {s: buffers[s] for s, w in works.items() if _settled(w, end, what, failed) and s in buffers}
    if failed:
        raise failed[0]
    return {s: got.get(s) for s in sources}


def _settled(work: Any, end: float, what: str, failed: list[PipelineError]) -> bool:
    """Whether ``work`` completed by ``end`` (``time.monotonic()``); its failure kept in ``failed``, raised after
    the others (once the time is up, the others get a millisecond each: they completed, or they fail)."""
    try:
        work.wait(timedelta(seconds=max(end - time.monotonic(), 0.001)))
        return True
    except Exception as err:
        failed.append(PipelineError(f"waiting for {what}: {type(err).__name__}: {err}"))
        failed[-1].__cause__ = err
        return False


def _buffer(keep: dict[int, torch.Tensor], source: int, size: int) -> torch.Tensor:
    if source not in keep or keep[source].numel() < size:
        keep[source] = torch.empty(size, dtype=torch.uint8)
    return keep[source][:size]


def send_bytes(data: torch.Tensor | None, dest: int, group: Any, timeout: float) -> None:
    """Send ``data`` (uint8, host; None: nothing) to group rank ``dest``: its length, then its bytes."""
    wait = _deadline(timeout)
    length = torch.tensor([_NOTHING if data is None else data.numel()], dtype=torch.int64)
    wait([dist.isend(length, group_dst=dest, group=group)], f"sending a snapshot's length to group rank {dest}")
    if data is not None and data.numel():
        wait([dist.isend(data, group_dst=dest, group=group)], f"sending a snapshot to group rank {dest}")


def recv_bytes(src: int, group: Any, timeout: float) -> torch.Tensor | None:
    """What :func:`send_bytes` sent from group rank ``src`` (None: nothing)."""
    wait = _deadline(timeout)
    length = torch.empty(1, dtype=torch.int64)
    wait([dist.irecv(length, group_src=src, group=group)], f"a snapshot's length from group rank {src}")
    n = int(length.item())
    if n < 0:
        return None
    data = torch.empty(n, dtype=torch.uint8)
    if n:
        wait([dist.irecv(data, group_src=src, group=group)], f"a snapshot from group rank {src}")
    return data


def _deadline(timeout: float) -> Any:
    """``wait(works, what)`` giving up after ``timeout`` seconds in all, with a :class:`PipelineError`."""
    delta = timedelta(seconds=timeout)

    def wait(works: Sequence[Any], what: str) -> None:
        for w in works:
            try:
                w.wait(delta)
            except Exception as err:
                raise PipelineError(f"waiting for {what}: {type(err).__name__}: {err}") from err

    return wait
