"""The shm transport's slots: one shared buffer per message stream, and the send / receive protocol on it.

*Layout.* One file in ``/dev/shm`` per (sender, receiver, tag, k, bytes), where
k is the op's index among the ops with that tag in one post (a value with
several tensors sends several). A 64-byte header holds ``seq`` (values written,
by the sender) and ``ack`` (values taken, by the receiver), int64 each, padded
so the bytes start aligned; then the bytes. Both sides open the file with
``O_CREAT`` and ``ftruncate`` it to the same size, so whichever comes first
creates it and neither can clobber the other.

*Send* of a slot's n-th value: wait until ``ack >= n - 1`` (the previous value
was taken; it only waits when the sender is a whole step ahead), copy the bytes
in, set ``seq = n``; the caller rings the receiver's doorbell (once per post).
The send is complete on return: the sender's tensor may be reused at once.

*Receive* of the n-th value: wait until ``seq >= n``, copy the bytes out, set
``ack = n``. The sender's doorbell is not rung: a sender waits for an ack only
when it is a whole step ahead, and then it looks every 1 ms; ringing would wake
it for nothing on most messages (measured: a wake-up per message costs more
CPU than the copy).

*Memory order.* The sender stores the bytes, then ``seq``; the receiver loads
``seq``, then the bytes. On x86-64 (total store order) stores are seen in
program order and loads are not reordered with older loads, so a receiver that
sees ``seq = n`` sees the value's bytes; the same holds for ``ack`` and the
slot's reuse. Weaker CPUs would need fences that Python cannot issue, so the
transport refuses to run elsewhere (``shm_peers.Peer.capable``).

*Names.* A receiver unlinks a slot once it has taken the slot's first value
(the sender has it mapped by then), before it acknowledges the value; what is
left goes when the channels close. The side that creates a name registers it
with the resource tracker (:mod:`.names`) and unregisters it once it is
gone: as the receiver when it unlinks, as the sender when it sees the first ack.
The sender looks for first acks at each of its sends to that receiver (the oldest first values first) and at
each step's end (:meth:`Channels.forget_taken`), not only at the slot's next value a step later: a sender that
dies in between leaves its tracker a name the receiver removed, which it would "clean up" with a warning.
"""

from __future__ import annotations

import glob
import mmap
import os
import stat
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .doorbell import POLL_S, Checker, Doorbells
from .names import open_private, track, unlink, untrack

_HEADER = 64  # seq and ack (int64 each), padded so the bytes start aligned
_ACK_POLL_S = 0.001  # a sender waiting for a slot to be taken is not rung: it looks this often


@dataclass
class _Slot:
    """One shared buffer between a sender and a receiver; ``count``: values this side posted on it."""

    path: str
    peer: int
    nbytes: int
    header: memoryview  # int64 [seq, ack]
    data: torch.Tensor  # uint8 view of the bytes
    mm: mmap.mmap
    receiving: bool  # this side takes values from it
    count: int = 0
    linked: bool = True  # its name is still in /dev/shm


@dataclass
class ShmWork:
    """A receive posted on a slot: :meth:`Channels.complete` waits for its value and copies it out."""

    slot: _Slot
    count: int
    tensor: torch.Tensor
    done: bool = False


class _Sent:
    """A send: complete once posted (the bytes are in the slot)."""

    done = True


SENT = _Sent()


@dataclass
class Channels:
    """The slot / doorbell protocol between the processes of one group on one host (see the module docstring).

    ``check(started, what, peer)`` is called every poll interval of a wait and
    raises to stop it (deadline, error board, dead peer).
    """

    prefix: str  # path prefix shared by all ranks, e.g. /dev/shm/sw-<nonce>
    rank: int
    size: int
    check: Checker
    _slots: dict[tuple[int, int, int, int, int], _Slot] = field(default_factory=dict)
    #: per receiver, the slots whose first value this side sent and has not yet seen taken, oldest first
    _unacked: dict[int, deque[_Slot]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.bells = Doorbells(self.prefix, self.rank, self.size, self.check)

    def forget_names(self) -> None:
        """Unlink this rank's doorbell from /dev/shm: call once every rank has opened every doorbell (a barrier)."""
        self.bells.forget_name()

    def ring(self, rank: int) -> None:
        self.bells.ring(rank)

    def await_(self, ready: Callable[[], bool], what: str, peer: int, poll: float = POLL_S) -> None:
        self.bells.await_(ready, what, peer, poll)

    def slot(self, src: int, dst: int, tag: int, k: int, nbytes: int) -> _Slot:
        key = (src, dst, tag, k, nbytes)
        found = self._slots.get(key)
        if found is None:
            path = f"{self.prefix}-{src}-{dst}-{tag}-{k}-{nbytes}"
            fd = _open(path)
            try:
                size = _HEADER + max(nbytes, 8)
                os.ftruncate(fd, size)  # both sides, same size: whoever comes second changes nothing
                mm = mmap.mmap(fd, size)
            finally:
                os.close(fd)
            with torch.inference_mode(False):  # kept for every later call: never an inference tensor (an eval's)
                data = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=_HEADER) if nbytes else _EMPTY
            receiving = dst == self.rank
            header = memoryview(mm)[:16].cast("q")
            found = self._slots[key] = _Slot(path, src if receiving else dst, nbytes, header, data, mm, receiving)
        return found

    def send(self, peer: int, tag: int, k: int, tensor: torch.Tensor, what: str) -> None:
        """Copy ``tensor`` into its slot once the slot's previous value was taken (the caller rings ``peer``)."""
        raw = _bytes_of(tensor)
        slot = self.slot(self.rank, peer, tag, k, raw.numel())
        slot.count += 1
        n, header = slot.count, slot.header
        if header[1] < n - 1:
            what = f"rank {peer} to take the previous {what}"
            self.bells.await_(lambda: header[1] >= n - 1, what, peer, _ACK_POLL_S)
        if slot.linked and n > 1:  # the first value was acknowledged, so the receiver has unlinked the name
            slot.linked = False
            untrack(slot.path)
        if slot.nbytes:
            slot.data.copy_(raw)
        header[0] = n  # after the bytes (see the module docstring on memory order)
        if slot.linked and n == 1:
            self._unacked.setdefault(peer, deque()).append(slot)
        self._forget_taken(peer)

    def forget_taken(self) -> None:
        """Unregister the names whose first value every receiver has taken (each unlinked the name before its ack)."""
        for peer in list(self._unacked):
            self._forget_taken(peer)

    def _forget_taken(self, peer: int) -> None:
        queue = self._unacked.get(peer)
        while queue and (not queue[0].linked or queue[0].header[1] >= 1):  # values to one peer are taken in order
            slot = queue.popleft()
            if slot.linked:
                slot.linked = False
                untrack(slot.path)

    def expect(self, peer: int, tag: int, k: int, tensor: torch.Tensor) -> ShmWork:
        """A receive into ``tensor`` of the next value on its slot."""
        slot = self.slot(peer, self.rank, tag, k, tensor.numel() * tensor.element_size())
        slot.count += 1
        return ShmWork(slot, slot.count, tensor)

    def complete(self, work: ShmWork, what: str) -> None:
        """Wait for the work's value, copy it out, hand the slot back to the sender."""
        if work.done:
            return
        header, n = work.slot.header, work.count
        if header[0] < n:
            self.bells.await_(lambda: header[0] >= n, what, work.slot.peer)
        slot = work.slot
        if slot.nbytes:
            _bytes_of(work.tensor).copy_(slot.data)
        if slot.linked:  # the sender wrote it, so both sides hold the mapping: the name has served
            slot.linked = False
            unlink(slot.path)  # before the ack: a sender that sees an ack knows the name is gone
        header[1] = n  # no ring: a sender rarely waits for this (only a whole step ahead), and then it polls
        work.done = True

    def unlink_all(self) -> None:
        """After a failure: unlink every file of the pipeline found in /dev/shm (a dead peer's included)."""
        for path in glob.glob(glob.escape(self.prefix) + "-*"):
            unlink(path)
        for slot in self._slots.values():
            slot.linked = False
            untrack(slot.path)

    def close(self, everything: bool) -> None:
        """Unlink this rank's slots as a receiver and its doorbell (with ``everything``: all the pipeline's files)."""
        if everything:
            self.unlink_all()
        for slot in self._slots.values():
            if slot.receiving and slot.linked:
                unlink(slot.path)
            untrack(slot.path)  # a sent value never taken: its receiver unlinks the name
        self.bells.close()
        self._slots, self._unacked = {}, {}  # the mappings go with their last tensor view


_EMPTY = torch.empty(0, dtype=torch.uint8)


def _open(path: str) -> int:
    """Open a slot's file, creating it if neither side has yet (mode 0600; a name someone else made is refused:
    :func:`.names.open_private`); the side that creates it tracks the name.

    One side only: ranks started by ``multiprocessing`` share one resource tracker, which keeps a name once,
    so a second registration would make the second unregistration an error in the tracker."""
    while True:
        try:
            fd, created = open_private(path, os.O_RDWR, stat.S_IFREG)
        except FileNotFoundError:  # unlinked in between (a failure's cleanup): create it again
            continue
        if created:
            track(path)
        return fd


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous CPU tensor (writes through it land in ``t``)."""
    return t.reshape(-1).view(torch.uint8)
