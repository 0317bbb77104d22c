"""The ``Transport`` protocol: moving values between the ranks of one pipeline, and nothing else.

The interpreter and the mailbox speak only this protocol; :mod:`.torch_p2p`
implements it over ``torch.distributed`` point-to-point (gloo on CPU, NCCL on
GPU), :mod:`stagewise.runtime.comm.shm` through shared memory between the
processes of one host. A new transport is one new module implementing it,
passed to the Pipeline as ``transport=`` (a factory, see :data:`TransportFactory`).

What a transport does, and why each belongs to it:

* *post*, two ways: batched (:meth:`Transport.post`), a run of the schedule's
  communication actions at once, as the schedule validator assumes (on NCCL a
  send and a receive between two ranks must be in flight together or both GPUs
  wait forever); eager (:meth:`Transport.post_eager`), one op at a time, for
  values whose shapes are not known yet (see :mod:`stagewise.runtime.engine.messages`);
* *wait for what it posted* (:meth:`Transport.watch`, :meth:`Transport.wait`),
  free sends whose value was used (:meth:`Transport.release`) and all sends at
  a step's end (:meth:`Transport.finish_sends`): only the transport knows its
  works (a shared-memory receive completes by a copy, a torch work by torch);
* the two small exchanges a train step ends with, the loss broadcast and the
  sum of the check for non-finite values (:meth:`Transport.broadcast`,
  :meth:`Transport.all_reduce`): a transport may move them faster than a
  collective would (shm does, through its slots);
* its lifecycle: :meth:`Transport.warm_up` before anything else communicates,
  :meth:`Transport.synchronize` for a GPU step's end, :meth:`Transport.close`
  when the pipeline is done (which lets go of its process groups);
* who: ``rank`` and ``size`` in the pipeline's ``group`` (the process group,
  also for the collectives the pipeline runs beside its transport), and
  ``grouped``, whether ops must be posted in the schedule's batches.

What it does not do: the error board, deadlines, "waiting for" and how
messages name this rank are the pipeline's :class:`~..faults.guard.Guard`,
``transport.guard``, made once per pipeline and shared by the transport and
every collective the pipeline issues. Every wait of a transport goes through
it, so a transport has no failure handling of its own to get wrong, and one
transport never borrows another's (the shm transport used to wrap a torch
transport for them). Tags: :func:`check_tag`, a property of the tag layout.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..faults.guard import Guard
from ..faults.waiters import Watch
from ..groups import backend_of, global_rank, group_rank

TAG_BITS = 20  # tags: pipeline id (10 bits) | message tag (20 bits)


def check_tag(tag: int) -> None:
    """Refuse a message tag that does not fit in its bits of the pipeline's tags (pipeline id | message tag)."""
    if not 0 <= tag < 1 << TAG_BITS:
        raise ValueError(f"message tag {tag} does not fit in {TAG_BITS} bits: too many stages x micro-batches")


@dataclass
class Op:
    """One tensor to send to / receive from group rank ``peer``, under a per-message ``tag``."""

    peer: int
    tensor: torch.Tensor
    send: bool
    tag: int = 0
    key: Any = None  # what the op belongs to, for the caller


class Transport(Protocol):
    """Moves values between the ranks of one pipeline; every wait is bounded and watched by ``guard``."""

    rank: int
    size: int
    grouped: bool  # ops must be posted in the schedule's batches (no receives ahead of the schedule)
    group: Any  # the process group, for the collectives the hybrid axes and diagnostics run
    guard: Guard  # the pipeline's error board, deadline and forensics (shared with its collectives)

    def post(self, ops: Sequence[Op]) -> list[list[Any]]: ...
    def post_eager(self, ops: Sequence[Op]) -> list[Any]: ...
    def watch(self, works: Sequence[Any]) -> Watch | None: ...
    def wait(self, works: Sequence[Any], what: str, *, eager: bool = False, watch: Watch | None = None) -> None: ...
    def release(self, works: Sequence[Any], what: str) -> None: ...
    def finish_sends(self) -> None: ...
    def broadcast(self, tensor: torch.Tensor, src: int, what: str) -> None: ...
    def all_reduce(self, tensor: torch.Tensor, op: str, what: str) -> None: ...
    def synchronize(self, device: torch.device) -> None: ...
    def warm_up(self) -> None: ...
    def close(self) -> None: ...


@dataclass(frozen=True)
class TransportSpec:
    """What a transport factory is given: the pipeline's group, how it names and bounds its waits, its guard."""

    group: Any
    name: str  # unique per pipeline, alike on every rank
    pipeline_id: int
    timeout: float
    store: Any = None  # the c10d store for the error board (None: the default group's)
    board: str | None = None  # pipelines sharing a board see each other's failures (one per mesh)
    label: str | None = None  # how messages name this rank
    guard: Guard | None = None  # the pipeline's guard; None: the factory makes one from the fields above


def guard_for(spec: TransportSpec) -> Guard:
    """The spec's guard, or a new one made from its fields (a factory makes it once, for the transport it picks).

    A spec whose guard watches another board than the spec names is refused: a factory that moves the spec to
    a shared board (HetPipe's virtual workers share one) would otherwise be silently ignored.
    """
    board = spec.name if spec.board is None else spec.board
    if spec.guard is not None:
        if spec.guard.board.name != board:
            raise ValueError(
                f"the transport spec names board {board!r} but its guard watches board {spec.guard.board.name!r}: "
                "make the guard from the final spec (guard_for), or leave it None"
            )
        return spec.guard
    me, nccl = spec.label or _me(spec.group), _nccl(spec.group)
    return Guard(board, spec.timeout, me, store=spec.store, orders_streams=nccl, scope=spec.name)


def _me(group: Any) -> str:
    """How messages name this rank: its rank in the pipeline, and its global rank where they differ (a pipeline
    on a sub-group, as HetPipe's virtual workers), so that every message names the process at fault."""
    mine, world = group_rank(group), global_rank()
    return f"rank {mine}" if mine == world else f"pipeline rank {mine} (global rank {world})"


def _nccl(group: Any) -> bool:
    return backend_of(group) == "nccl"


#: builds a pipeline's transport; the default is ``"auto"`` (see :mod:`..choose_transport`)
TransportFactory = Callable[[TransportSpec], Transport]
