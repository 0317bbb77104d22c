"""The ``Transport`` protocol: what the engine needs to move values between the ranks of one pipeline.

The interpreter and the mailbox speak only this protocol; :mod:`.torch_p2p`
implements it over ``torch.distributed`` point-to-point (gloo on CPU, NCCL on
GPU). A new transport (shared memory between ranks of one host, say) is one
new file here implementing it, passed to the Pipeline as ``transport=`` (a
factory, see :data:`TransportFactory`).

Two ways to post:

* *batched* (:meth:`Transport.post`): a run of the schedule's communication
  actions at once, as the schedule validator assumes (on NCCL a send and a
  receive between two ranks must be in flight together or both GPUs wait
  forever);
* *eager* (:meth:`Transport.post_eager`): one op at a time, for values whose
  shapes are not known yet (see :mod:`stagewise.runtime.engine.messages`).

Every wait has a deadline and watches the error board: no rank hangs when
another fails.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch

from ..faults.waits import Watch

T = TypeVar("T")

TAG_BITS = 20  # tags: pipeline id (10 bits) | message tag (20 bits)


@dataclass
class Op:
    """One tensor to send to / receive from group rank ``peer``, under a per-message ``tag``."""

    peer: int
    tensor: torch.Tensor
    send: bool
    tag: int = 0
    key: Any = None  # what the op belongs to, for the caller


class Transport(Protocol):
    """Point-to-point between the ranks of one pipeline, with deadline-bounded waits and an error board."""

    rank: int
    size: int
    me: str  # how failure messages name this rank
    grouped: bool  # ops must be posted in the schedule's batches (no receives ahead of the schedule)
    group: Any  # the process group, for the collectives the hybrid axes and diagnostics run
    timeout: float

    @property
    def failure(self) -> str | None: ...
    @property
    def waiting(self) -> str: ...
    def check_tag(self, tag: int) -> None: ...
    def fail(self, message: str) -> str: ...
    def check(self) -> None: ...
    def post(self, ops: Sequence[Op]) -> list[list[Any]]: ...
    def post_eager(self, ops: Sequence[Op]) -> list[Any]: ...
    def watch(self, works: Sequence[Any]) -> Watch | None: ...
    def wait(self, works: Sequence[Any], what: str, *, eager: bool = False, watch: Watch | None = None) -> None: ...
    def release(self, works: Sequence[Any], what: str) -> None: ...
    def finish_sends(self) -> None: ...
    def broadcast(self, tensor: torch.Tensor, src: int, what: str) -> None: ...
    def all_reduce(self, tensor: torch.Tensor, op: str, what: str) -> None: ...
    def call(self, fn: Callable[[], T], what: str) -> T: ...
    def synchronize(self, device: torch.device) -> None: ...
    def warm_up(self) -> None: ...
    def drop_groups(self) -> None: ...
    def close(self) -> None: ...


@dataclass(frozen=True)
class TransportSpec:
    """What a transport factory is given: the pipeline's group and how it names and bounds its waits."""

    group: Any
    name: str  # unique per pipeline, alike on every rank
    pipeline_id: int
    timeout: float
    store: Any = None  # the c10d store for the error board (None: the default group's)
    board: str | None = None  # pipelines sharing a board see each other's failures (one per mesh)
    label: str | None = None  # how messages name this rank


#: builds a pipeline's transport; the default is :class:`~.torch_p2p.TorchTransport`
TransportFactory = Callable[[TransportSpec], Transport]
