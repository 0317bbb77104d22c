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
gloo's I/O threads' CPU). First exchanges and variable shapes
(``post_eager``) go over torch point-to-point on the same gloo group, through
the pieces the torch transport posts with (:mod:`..transport.p2p`): a value
whose shapes are not known yet has no slot to go to. The error board,
deadlines and forensics are the pipeline's :class:`~..faults.guard.Guard`,
which every wait here goes through (a doorbell's every 50 ms, see
:meth:`ShmTransport._check`); the guard tells this transport when a failure
is learnt, wherever it is learnt, so that the names go at once (below).

The pieces, a file each:

* ``peers.py``: who the peers are (host, boot, namespaces, pid and start
  time), whether they can use shared memory, the refusal of a group that cannot;
* ``slots.py``: the slot layout in ``/dev/shm`` and the send / receive
  protocol on it (:class:`Channels`), including memory order;
* ``names.py``: the names' removal, by this process or, if it dies
  holding them, by the resource tracker;
* ``doorbell.py``: the notification, a named pipe per rank and a sleeping
  ``poll`` on it (no spinning), which looks at the error board, the deadline and
  the peer's process every 50 ms;
* this file: the :class:`~..transport.protocol.Transport` on top, and its construction.

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
them once the process is gone (``names.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ...errors import PipelineError
from ..faults import divergence
from ..faults.guard import Guard
from ..faults.waiters import Watch
from ..groups import backend_of, global_ranks
from ..transport.p2p import Addresses, Eager
from ..transport.protocol import Op, TransportSpec, guard_for
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

#: the slots' tags of the step-end exchanges: below every message tag (those are >= 0)
_BROADCAST_TAG, _REDUCE_TAG = -1, -2
#: the reductions :meth:`ShmTransport.all_reduce` applies, in group-rank order on every rank
_REDUCE: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {"sum": torch.add, "max": torch.maximum}


# ---- the transport ------------------------------------------------------------------------
class ShmTransport:
    """The :class:`~..transport.protocol.Transport` for ranks on one host: steady-state point-to-point through
    /dev/shm, eager ops over torch on the same gloo group, every wait bounded by the pipeline's guard.

    Built by :func:`shm_transport` (or ``transport="auto"`` / ``"shm"``), after
    every rank's :class:`Peer` was gathered.
    """

    grouped = False  # every op completes on its own; receives may be posted ahead of the schedule

    def __init__(self, spec: TransportSpec, peers: Sequence[Peer], guard: Guard | None = None) -> None:
        self.group = spec.group
        self.rank, self.size = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.guard = guard if guard is not None else guard_for(spec)
        self.eager = Eager(self.group, Addresses(self.group, spec.pipeline_id), self.guard)
        self.peers = list(peers)
        nonce = self.peers[0].nonce  # group rank 0's: alike on every rank
        self.channels = Channels(f"{SHM_DIR}/sw-{nonce}", self.rank, self.size, self._check)
        self._unlinked = False
        self.guard.when_failed(self._failed)  # whoever learns of a failure first, the names go at once
        opened = dist.barrier(group=self.group, async_op=True)
        self.guard.wait([opened], "every rank opening its doorbells")  # then their names can go
        self.channels.forget_names()

    def _failed(self) -> None:
        """The pipeline is over: its names in /dev/shm go now (a rank may end with ``os._exit`` after this)."""
        if not self._unlinked:
            self._unlinked = True
            self.channels.unlink_all()

    def _check(self, started: float, what: str, peer: int) -> None:
        """Stop a wait: a failure posted anywhere, the deadline, or the peer's process gone."""
        self.guard.check_deadline(started, what)
        who = self.peers[peer]
        if not who.alive():  # the peer first: it is the one at fault (its global rank where that differs)
            g = global_ranks(self.group)[peer]
            ended = divergence.ended_words(
                g, self.guard.scope
            )  # no death: its script ended, in a call this rank has not made
            if ended:
                raise PipelineError(self.guard.fail(f"{ended} ({self.guard.me} waited for {what})"))
            dead = f"rank {peer}" if g == peer else f"pipeline rank {peer} (global rank {g})"
            raise PipelineError(self.guard.fail(f"{dead} died (pid {who.pid}): {self.guard.me} waited for {what}"))

    # ---- posting
    def post(self, ops: Sequence[Op]) -> list[list[Any]]:
        """Sends are copied into their slots now (complete on return); receives are completed by :meth:`wait`."""
        self.guard.live()
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
        """Over torch point-to-point on the gloo group: shapes not known yet have no slot to go to."""
        return self.eager.post(ops)

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
        self.guard.live()
        flat = _flat(tensor, what)
        peers = [p for p in range(self.size) if p != self.rank]
        try:
            for p in peers:
                self.channels.send(p, tag, 0, flat, what)
        finally:
            for p in peers:
                self.channels.ring(p)

    def warm_up(self) -> None:
        """Nothing: a gloo group needs no first collective (NCCL's does, and this transport refuses NCCL)."""

    # ---- waiting
    def watch(self, works: Sequence[Any]) -> Watch | None:
        """No helper thread for shared-memory works (taking an arrived value costs no hand-off); eager works:
        the guard's."""
        return self.guard.watch([w for w in works if not _mine(w)])

    def wait(self, works: Sequence[Any], what: str, *, eager: bool = False, watch: Watch | None = None) -> None:
        """Block until ``works`` complete (copying received values out), within the deadline, watching the board."""
        self.guard.wait([w for w in works if not _mine(w)], what, watch=watch, blocking=eager)
        pending = [w for w in works if isinstance(w, ShmWork) and not w.done]
        if not pending:
            return
        self.guard.live()
        self.guard.waiting = what  # the doorbell's waits poll the guard's deadline (see _check)
        try:
            for w in pending:
                self.channels.complete(w, what)
        except PipelineError:
            raise
        except Exception as err:
            raise PipelineError(
                self.guard.fail(f"{self.guard.me}: {what} failed: {type(err).__name__}: {err}")
            ) from err

    def release(self, works: Sequence[Any], what: str) -> None:
        """Nothing to do: a send through a slot is complete once posted, and eager sends end with the step."""

    def finish_sends(self) -> None:
        """Wait for the eager sends (those through slots completed when posted); unregister the names of slots
        whose first value was taken (see .slots: a rank killed between steps leaves its tracker nothing gone)."""
        self.eager.finish()
        self.channels.forget_taken()

    def synchronize(self, device: torch.device) -> None:
        """On CUDA (a gloo group with device="cuda"), wait for queued kernels and copies, watching the board."""
        self.guard.wait_gpu(device, "the GPU to finish the step")

    # ---- lifecycle
    def close(self) -> None:
        """Unlink the shared files (see the module docstring), stop the guard's helpers, let go of the group."""
        self.channels.close(everything=self.guard.failure is not None and not self._unlinked)
        self.guard.close()
        if self.guard.failure is None:
            self.group = None
            self.eager.forget_group()


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
    guard = guard_for(spec)  # the pipeline's: its error board and deadline watch the gather
    peers = gather_peers(spec.group, guard.wait)
    check_shm_group(backend, peers)
    return ShmTransport(spec, peers, guard)
