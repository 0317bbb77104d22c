"""The snapshots' commit returns only once gloo's worker let go of its tensor (a process exiting after it never aborts).

A gloo collective is run by a worker thread of its group, which drops the work (and its tensors) after the waiter
has returned; when that comes as the interpreter finalizes, the worker is ended inside torch's C++ frames and the
process aborts ("terminate called without an active exception": an in-place elastic job's reference run, 1 in 14,
its rank 0 exiting right after the last snapshot's commit; see :mod:`stagewise.runtime.comm.blocking`). The
snapshot group's threads run at ``SCHED_IDLE`` (:mod:`stagewise.runtime.elastic.idle`); here the process is held
on one CPU, where the woken commit thread and the test's thread preempt the worker at once: without the wait for
it, every commit returns while the worker still holds the tensor."""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from stagewise.runtime.comm import snapshot_wire
from stagewise.runtime.elastic import idle

pytestmark = pytest.mark.skipif(
    not (idle.wanted() and hasattr(os, "sched_setaffinity")), reason="SCHED_IDLE and CPU affinity (Linux)"
)


@pytest.fixture
def idle_group_on_one_cpu() -> Iterator[Any]:
    """A one-process gloo group whose threads run at SCHED_IDLE, every thread of it on one CPU (the test's too)."""
    cpus = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(cpus)})  # (this thread; the group's threads, made by it, inherit it)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        made: list[int] = []
        with idle.new_threads_idle(made):
            group = dist.new_group([0], backend="gloo")
        assert made, "the group's threads did not go idle"
        yield group
    finally:
        dist.destroy_process_group()
        os.sched_setaffinity(0, cpus)


def test_each_commit_returns_after_gloos_worker_let_go_of_its_tensor(
    idle_group_on_one_cpu: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    reduced: list[weakref.ref[torch.Tensor]] = []
    all_reduce = dist.all_reduce

    def noting(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        reduced.append(weakref.ref(tensor))  # (no reference of the test's: the tensor goes when torch lets go)
        return all_reduce(tensor, *args, **kwargs)

    monkeypatch.setattr(dist, "all_reduce", noting)
    held = []
    for step in range(1, 6):
        assert snapshot_wire.lowest(step, idle_group_on_one_cpu, 10.0) == step
        held.append(reduced[-1]() is not None)  # alive: a thread of torch holds it still
    assert held == [False] * 5, held
