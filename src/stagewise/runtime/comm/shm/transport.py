"""A same-host transport: boundary values through shared memory, doorbells through named pipes.

Why: a gloo message on loopback costs ~170 us (a socket round trip plus
gloo's own I/O threads), which caps the efficiency of schedules that send
many small messages. Ranks on one host can instead copy each value into a
shared buffer and wake the receiver with one byte.

What goes where. The steady state moves through shared memory: the
schedule's batched point-to-point (:meth:`ShmTransport.post`), whose shapes
both ends know, and the two small exchanges every train step ends with, the
loss broadcast and the all-reduce of the check for non-finite values
(:meth:`ShmTransport.broadcast`, :meth:`ShmTransport.all_reduce`: as gloo
collectives on 4 ranks of a loaded 2-core host they took ~1 ms each, plus
gloo's I/O threads' CPU). Everything else goes through an inner
:class:`~.torch_p2p.TorchTransport` on the same group, unchanged: first
exchanges and variable shapes (``post_eager``), the collectives of the hybrid
axes, the error board, deadlines and forensics.

The pieces, a file each:

* ``shm_peers.py``: who the peers are (host, boot, namespaces, pid and start
  time), whether they can use shared memory, the refusal of a group that cannot;
* ``shm_slots.py``: the slot layout in ``/dev/shm`` and the send / receive
  protocol on it (:class:`Channels`), including memory order;
* ``shm_names.py``: the names' removal, by this process or, if it dies
  holding them, by the resource tracker;
* ``shm_doorbell.py``: the notification, a named pipe per rank and a sleeping
  ``poll`` on it (no spinning), which looks at the error board, the deadline and
  the peer's process every 50 ms;
* this file: the :class:`~.transport.Transport` on top, and its construction.

Names in /dev/shm live only as long as needed, so that a process that ends
without cleaning up (``os._exit``, a signal) leaves little behind: they
carry a nonce drawn by group rank 0 when the transport is built (runs and
pipelines never share a file); every rank opens every doorbell when the
transport is built, and after a barrier each unlinks its own; a receiver
unlinks a slot once it has taken the slot's first value. What is left (slots
never used to the end) goes when the transport closes. A failure ends the
pipeline: every rank unlinks every file of the pipeline it finds as soon as
it learns of it (a failed rank may end with ``os._exit``). A process killed
holding names (all ranks killed, or torchrun ending the survivors before they
learn of the failure) leaves them to Python's resource tracker, which unlinks
them once the process is gone (``shm_names.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ...errors import PipelineError
from ..faults.waits import Watch
from ..groups import backend_of
from ..transport.protocol import Op, TransportSpec
from ..transport.torch_p2p import TorchTransport
from .doorbell import Checker
from .peers import SHM_DIR, Peer, check_shm_group, gather_peers, same_host
from .slots import SENT, Channels, ShmWork, _Sent

__all__ = [
    "SHM_DIR",
    "Channels",
    "Checker",
    "Peer",
    "ShmTransport",
    "ShmWork",
    "check_shm_group",
    "gather_peers",
    "same_host",
    "shm_transport",
]

T = TypeVar("T")

#: the slots' tags of the step-end exchanges: below every message tag (those are >= 0)
_BROADCAST_TAG, _REDUCE_TAG = -1, -2
#: the reductions :meth:`ShmTransport.all_reduce` applies, in group-rank order on every rank
_REDUCE = {"sum": torch.add, "max": torch.maximum}


# ---- the transport ------------------------------------------------------------------------
class ShmTransport:
    """The :class:`~.transport.Transport` for ranks on one host: steady-state point-to-point through /dev/shm.

    Built by :func:`shm_transport` (or ``transport="auto"`` / ``"shm"``), after
    every rank's :class:`Peer` was gathered.
    """

    grouped = False  # every op completes on its own; receives may be posted ahead of the schedule

    def __init__(self, spec: TransportSpec, peers: Sequence[Peer], inner: TorchTransport | None = None) -> None:
        self.inner = inner if inner is not None else TorchTransport(spec)
        self.rank, self.size, self.me = self.inner.rank, self.inner.size, self.inner.me
        self.timeout = spec.timeout
        self.peers = list(peers)
        nonce = self.peers[0].nonce  # group rank 0's: alike on every rank
        self.channels = Channels(f"{SHM_DIR}/sw-{nonce}", self.rank, self.size, self._check)
        opened = dist.barrier(group=self.inner.group, async_op=True)
        self.inner.wait([opened], "every rank opening its doorbells")  # then their names can go
        self.channels.forget_names()
        self._unlinked = False

    # ---- the inner transport's state
    @property
    def group(self) -> Any:
        return self.inner.group

    @property
    def failure(self) -> str | None:
        return self.inner.failure

    @property
    def waiting(self) -> str:
        return self.inner.waiting

    def reset_waiting(self) -> None:
        self.inner.reset_waiting()

    def call(self, fn: Callable[[], T], what: str) -> T:
        return self.inner.call(fn, what)

    def check_tag(self, tag: int) -> None:
        self.inner.check_tag(tag)

    def fail(self, message: str) -> str:
        try:
            return self.inner.fail(message)
        finally:
            self._failed()

    def check(self) -> None:
        with self._guard():
            self.inner.check()

    def _live(self) -> None:
        """Raise if a failure is known here (no store round trip: the waits look at the board while they wait)."""
        if self.inner.failure is not None:
            self._failed()
            raise PipelineError(self.inner.failure)

    def _failed(self) -> None:
        """The pipeline is over: its names in /dev/shm go now (a rank may end with ``os._exit`` after this)."""
        if not self._unlinked:
            self._unlinked = True
            self.channels.unlink_all()

    @contextlib.contextmanager
    def _guard(self) -> Iterator[None]:
        try:
            yield
        except PipelineError:
            self._failed()
            raise

    def _check(self, started: float, what: str, peer: int) -> None:
        """Stop a wait: a failure posted anywhere, the deadline, or the peer's process gone."""
        self.inner.waits.check_deadline(started, what)
        who = self.peers[peer]
        if not who.alive():
            raise PipelineError(self.fail(f"{self.me}: {what} failed: peer rank {peer} (pid {who.pid}) died"))

    # ---- posting
    def post(self, ops: Sequence[Op]) -> list[list[Any]]:
        """Sends are copied into their slots now (complete on return); receives are completed by :meth:`wait`."""
        self._live()
        counts: dict[tuple[int, int, bool], int] = {}
        out: list[list[Any]] = []
        rung: set[int] = set()
        try:
            for op in ops:
                t = op.tensor  # on a GPU (a gloo group with device="cuda"), copy_ stages through the slot
                if not t.is_contiguous():
                    raise ValueError(
                        f"the shm transport moves contiguous tensors; got a non-contiguous one of shape "
                        f"{tuple(t.shape)} for rank {op.peer}"
                    )
                key = (op.peer, op.tag, op.send)
                k = counts[key] = counts.get(key, -1) + 1
                if op.send:
                    with self._guard():
                        self.channels.send(op.peer, op.tag, k, t, f"value under tag {op.tag}")
                    rung.add(op.peer)
                    out.append([SENT])
                else:
                    out.append([self.channels.expect(op.peer, op.tag, k, t)])
        finally:
            for peer in rung:  # what was written is there: let the receivers know
                self.channels.ring(peer)
        return out

    def post_eager(self, ops: Sequence[Op]) -> list[Any]:
        return self.inner.post_eager(ops)

    def broadcast(self, tensor: torch.Tensor, src: int, what: str) -> None:
        """``tensor`` from group rank ``src`` to every rank, in place: ``src`` copies it into each peer's slot."""
        if self.size == 1:
            return
        if self.rank == src:
            self._send_all(tensor, _BROADCAST_TAG, what)
        else:
            self.wait([self.channels.expect(src, _BROADCAST_TAG, 0, _flat(tensor, what))], what)

    def all_reduce(self, tensor: torch.Tensor, op: str, what: str) -> None:
        """Reduce ``tensor`` in place over the group: every rank sends its value to every other and reduces all
        of them in group-rank order, so every rank computes the same bits (a small tensor: n - 1 copies each)."""
        if op not in _REDUCE:
            raise ValueError(f"all_reduce: op must be one of {sorted(_REDUCE)}, got {op!r}")
        if self.size == 1:
            return
        mine = _flat(tensor, what).clone()
        self._send_all(mine, _REDUCE_TAG, what)
        parts = {p: torch.empty_like(mine) for p in range(self.size) if p != self.rank}
        self.wait([self.channels.expect(p, _REDUCE_TAG, 0, t) for p, t in parts.items()], what)
        parts[self.rank] = mine
        total = parts[0]
        for p in range(1, self.size):
            total = _REDUCE[op](total, parts[p])
        tensor.copy_(total)

    def _send_all(self, tensor: torch.Tensor, tag: int, what: str) -> None:
        """Copy ``tensor`` into a slot to every other rank, then ring them."""
        self._live()
        flat = _flat(tensor, what)
        peers = [p for p in range(self.size) if p != self.rank]
        try:
            with self._guard():
                for p in peers:
                    self.channels.send(p, tag, 0, flat, what)
        finally:
            for p in peers:
                self.channels.ring(p)

    def warm_up(self) -> None:
        self.inner.warm_up()

    # ---- waiting
    def watch(self, works: Sequence[Any]) -> Watch | None:
        """No helper thread for shared-memory works (taking an arrived value costs no hand-off); others: inner."""
        others = [w for w in works if not _mine(w)]
        return self.inner.watch(others) if others else None

    def wait(self, works: Sequence[Any], what: str, *, eager: bool = False, watch: Watch | None = None) -> None:
        """Block until ``works`` complete (copying received values out), within the deadline, watching the board."""
        others = [w for w in works if not _mine(w)]
        if others:
            with self._guard():
                self.inner.wait(others, what, eager=eager, watch=watch)
        pending = [w for w in works if isinstance(w, ShmWork) and not w.done]
        if not pending:
            return
        self._live()
        self.inner.waits.waiting = what
        try:
            with self._guard():
                for w in pending:
                    self.channels.complete(w, what)
        except PipelineError:
            raise
        except Exception as err:
            raise PipelineError(self.fail(f"{self.me}: {what} failed: {type(err).__name__}: {err}")) from err

    def release(self, works: Sequence[Any], what: str) -> None:
        others = [w for w in works if not _mine(w)]
        if others:
            with self._guard():
                self.inner.release(others, what)

    def finish_sends(self) -> None:
        with self._guard():
            self.inner.finish_sends()

    def synchronize(self, device: torch.device) -> None:
        self.inner.synchronize(device)

    # ---- lifecycle
    def drop_groups(self) -> None:
        self.close()
        self.inner.drop_groups()

    def close(self) -> None:
        """Unlink the shared files (see the module docstring) and stop the inner transport's helpers."""
        self.channels.close(everything=self.inner.failure is not None and not self._unlinked)
        self.inner.close()


def _flat(tensor: torch.Tensor, what: str) -> torch.Tensor:
    """``tensor``, checked contiguous: a slot copies to and from its bytes in place."""
    if not tensor.is_contiguous():
        raise ValueError(f"{what}: the shm transport moves contiguous tensors, got one of shape {tuple(tensor.shape)}")
    return tensor


def _mine(work: Any) -> bool:
    return isinstance(work, (ShmWork, _Sent))


def shm_transport(spec: TransportSpec) -> ShmTransport:
    """The shared-memory transport: every rank of ``spec.group`` must be on this host (a collective)."""
    backend = backend_of(spec.group)
    if backend != "gloo":  # alike on every rank: refuse before any collective
        check_shm_group(backend, [Peer.here()])
    inner = TorchTransport(spec)  # its error board and deadline watch the gather
    peers = gather_peers(spec.group, inner.wait)
    check_shm_group(backend, peers)
    return ShmTransport(spec, peers, inner)
