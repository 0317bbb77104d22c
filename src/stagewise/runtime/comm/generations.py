"""The process group of one generation, met on the store that outlives the machines - in the same process.

torch's default group cannot change its members, and under torchrun its store lives in global rank 0's
process: neither survives a lost machine. An in-place elastic job instead meets, at every generation ``g``,
under ``PrefixStore("gen<g>/pg/", store)`` of the store ``stagewise rendezvous`` hosts, with this worker's
rank among the generation's members. The group of the generation before is given up first: its ops on a
dead peer have already failed (a killed peer: at once; a stopped one: at the group's timeout), so taking it
down joins no stuck thread (measured with gloo: 10-20 ms, threads and descriptors back to where they were).

What stagewise keeps per run in the process (the run's scope on the store, the heartbeat, the exit hook's
stores, pipelines' names) is started again for the generation, so that no key of the last one is read.

The generation a state was trained in is recorded with it (snapshot headers, checkpoint records: :func:`recorded`)
so that a resume prefers the newest generation's state (:mod:`..checkpoint.newest`). It is the membership
generation joined here (0 in a job that never changes members), counted on from the state a restore took
(:func:`count_from`), so that it never goes down along a job's history: a job whose store started again (its
generations from 0) after resuming a generation-5 state records 5, 6, ..., never 0 below an older branch's 5.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist

from . import coordinator, groups
from .faults import exit_hook, heartbeat

_joined = [0]  # the membership generation this process is in (0: none joined, or the first)
_base = [0]  # what a restore counted on from (see count_from)


def recorded() -> int:
    """The generation the states trained in this process now are recorded with (snapshots, checkpoints)."""
    return _base[0] + _joined[0]


def count_from(restored: int) -> None:
    """A restore took a state recorded at generation ``restored`` (every member alike): count on from it. At the
    first generation, the next states are of that generation; after a change of members, of the next one (never
    below the membership generation itself)."""
    after = restored + (1 if _joined[0] > 0 else 0)
    _base[0] = max(0, after - _joined[0])


def join_generation(store: Any, generation: int, rank: int, size: int, backend: str, timeout: float) -> None:
    """Make the default process group this generation's: ``rank`` of ``size``, on ``store`` (the job's
    prefix of the store that outlives the machines). Called by every member alike; a barrier (gloo's own
    handshake) bounded by ``timeout``."""
    leave_generation()
    _joined[0] = generation
    where = dist.PrefixStore(f"gen{generation}/pg/", store)
    dist.init_process_group(backend, store=where, rank=rank, world_size=size, timeout=timedelta(seconds=timeout))
    coordinator.adopt_nonce(f"inplace-g{generation}")  # the run's keys: alike on every member
    heartbeat.start(min(timeout, 60.0), pipeline=False)


def leave_generation() -> None:
    """Give up this process's group and stagewise's state for it (no-op when there is none)."""
    heartbeat.stop()
    exit_hook.forget_stores()
    groups.forget()
    if dist.is_initialized():
        dist.destroy_process_group()
    groups.forget_meshes()  # (the next generation's meshes compare equal to this one's: see there)


def job_store(where: str, job: str, timeout: float) -> Any:
    """A client of the store at ``where`` (host:port, ``stagewise rendezvous``'s), under the job's own prefix."""
    host, port = where.rsplit(":", 1)
    client = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout), wait_for_workers=False)
    return dist.PrefixStore(f"stagewise-inplace/{job}/", client)
