"""A re-layout's traffic (:mod:`stagewise.runtime.relayout`): fresh groups per generation, tensors by point-to-point.

Every group a re-layout makes is new (``dist.new_group`` names each by a count every process of the world
advances alike, so a generation never reuses an earlier one's store keys); the tensors go over gloo between
the processes' host memory, posted by every process in one global order so the sends and receives pair up.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .groups import forget_meshes
from .release import hold as hold_until


def fresh_group(ranks: Sequence[int], timeout: float, backend: str | None = None) -> Any:
    """A new process group of the global ``ranks``, made by every process of the world (in one order)."""
    return dist.new_group(list(ranks), backend=backend, timeout=timedelta(seconds=timeout))


def release(group: Any) -> None:
    """Let go of a group this process made (nothing for one it is not in)."""
    if group is not None and group is not dist.GroupMember.NON_GROUP_MEMBER:
        dist.destroy_process_group(group)
        forget_meshes()


def release_failed(group: Any, timeout: float) -> None:
    """Let go of the exchange group of a re-layout that failed, without waiting for it.

    A process that failed never joins the collective the others may have begun (the commit point), and gloo's
    group destructor waits for that collective until the group's timeout: dropped here, every process would
    raise its PipelineError ``timeout`` seconds late (measured: 60 s with ``timeout=60``). The last reference
    is dropped on the release thread once the timeout has ended that collective (:mod:`.release`: at exit, in
    order, while Python is whole).
    """
    if group is None or group is dist.GroupMember.NON_GROUP_MEMBER:
        return
    dist.destroy_process_group(group)
    forget_meshes()
    hold_until(group, timeout + 1.0)


def post(ops: Sequence[tuple[str, torch.Tensor, int]], group: Any, wait: Callable[[list[Any], str], None]) -> None:
    """Post ``("send", tensor, dst)`` and ``("recv", tensor, src)`` (global ranks) in order, then wait for all."""
    works = []
    for kind, tensor, peer in ops:
        op = dist.isend if kind == "send" else dist.irecv
        works.append(op(tensor, peer, group=group))
    if works:
        wait(works, f"the re-layout's {len(works)} tensor transfers")
