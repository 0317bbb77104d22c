"""The snapshots' traffic (:mod:`stagewise.runtime.elastic`): a gloo group of its own, and what goes over it.

The copies to the peers run on a helper thread while the pipeline trains, so they get their own process
group (gloo, host memory: on GPUs too the copy is taken to the host first), never the pipeline's. Here: the
group, a gather, the commit's all-reduce and a plain send of bytes; a copy's exchange between peers is
:mod:`.snapshot_exchange`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..errors import PipelineError
from . import groups
from .blocking import letting_go
from .collectives import gather_json
from .snapshot_exchange import failure_of

_NOTHING = -1  # a length sent for nothing to send
_POLL_S = 0.1  # how often a waiting commit asks whether to give up


def snapshot_group(group: Any, timeout: float) -> Any:
    """A gloo group of ``group``'s ranks (None: the world). ``dist.new_group`` is called by every process of the
    world, in one order (a group made by its members alone is named by a count each process keeps, which other
    groups made that way can put out of step): when the pipeline is not the whole world, every rank's pipeline
    group is gathered first and each made in turn, as every rank builds its pipeline at the same time."""
    mine = tuple(groups.global_ranks(group))
    ready = groups.take_gloo(mine)  # made ahead by a re-layout onto fewer processes (relayout/call.py)
    if ready is not None:
        return ready
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


def lowest(
    value: int,
    group: Any,
    timeout: float,
    give_up: Callable[[], bool] | None = None,
    around: Callable[[], AbstractContextManager[Any]] | None = None,
) -> int:
    """The lowest of every group rank's ``value`` (an all-reduce), or a :class:`PipelineError` when it failed,
    did not end within ``timeout`` seconds, or ``give_up()`` turned true first. The all-reduce runs on a thread
    of its own (``around()``: its context), so a peer that never joins holds the caller only until the run's
    failure is posted (gloo cannot cancel it: the abandoned thread ends at the timeout); it returns once gloo's
    worker let go of the tensor (:func:`.blocking.letting_go`: the last commit is waited for at exit)."""
    out = torch.tensor([value], dtype=torch.int64)
    box: dict[str, PipelineError] = {}
    ended = threading.Event()

    def run() -> None:
        with (around or nullcontext)():
            try:
                with letting_go(out, timeout):  # (the last commit's worker must not let go as the process exits)
                    work = dist.all_reduce(out, op=dist.ReduceOp.MIN, group=group, async_op=True)
                    work.wait(timedelta(seconds=timeout))
                    del work  # (held here, the work would outlive the worker's hold: nothing to wait for)
            except Exception as err:
                box["failed"] = failure_of(err, "the snapshots' commit")
            finally:
                ended.set()

    threading.Thread(target=run, name="stagewise-snapshot-commit", daemon=True).start()
    end = time.monotonic() + timeout
    while not ended.wait(min(_POLL_S, max(end - time.monotonic(), 0.0))):
        if give_up is not None and give_up():
            raise PipelineError("the snapshots' commit: given up, the run failed")
        if time.monotonic() >= end:
            raise PipelineError(f"the snapshots' commit did not end within {timeout:g} s")
    if "failed" in box:
        raise box["failed"]
    return int(out.item())


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
