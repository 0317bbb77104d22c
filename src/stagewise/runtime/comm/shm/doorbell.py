"""The shm transport's notification: one named pipe (FIFO) per rank, a sleeping wait on it, no spinning.

Why not spin on the shared counters: on a 2-core machine a spinning rank steals
its neighbour's core. Why a pipe: it needs nothing but the kernel and works
with ``poll`` (no limit on the fd number).

One doorbell per rank, opened read-write and non-blocking by every rank of the
group (read-write: the open never blocks and never fails for want of a reader).
Ringing writes one byte; a full pipe already rings. A waiter sleeps in ``poll``
on its own doorbell, re-checks its condition on every wake-up (a ring says
"something changed", not what), and every 50 ms of quiet (or of frequent
wake-ups) calls the transport's check: error board, deadline, peer alive.
"""

from __future__ import annotations

import os
import select
import stat
import time
from collections.abc import Callable

from .names import open_private, track, unlink, untrack

POLL_S = 0.05  # how long a wait sleeps before it looks at the board, the clock and the peer

#: raises PipelineError when a wait for ``peer`` must stop: (started, what, peer) -> None
Checker = Callable[[float, str, int], None]


class Doorbells:
    """Every doorbell of one group on one host, as seen by ``rank``; ``prefix`` names the group's files."""

    def __init__(self, prefix: str, rank: int, size: int, check: Checker) -> None:
        self.prefix, self.rank, self.check = prefix, rank, check
        self._fds: dict[int, int] = {}
        for peer in range(size):  # every doorbell, now: see forget_name
            self._open(peer)
        self._mine = self._fds[rank]
        self._poller = select.poll()
        self._poller.register(self._mine, select.POLLIN)

    def path(self, rank: int) -> str:
        return f"{self.prefix}-bell{rank}"

    def _open(self, rank: int) -> int:
        fd = self._fds.get(rank)
        if fd is None:
            path = self.path(rank)
            made = False
            try:
                os.mkfifo(path, 0o600)
                track(path)  # created here: removed by the tracker if this process dies before forget_name
                made = True
            except FileExistsError:
                pass
            # RDWR: never blocks, never ENXIO; a name someone else made is refused (see .names.open_private)
            fd = self._fds[rank] = open_private(path, os.O_RDWR | os.O_NONBLOCK, stat.S_IFIFO, made=made)[0]
        return fd

    def forget_name(self) -> None:
        """Unlink this rank's doorbell from /dev/shm: call once every rank has opened every doorbell (a barrier).

        Each rank unlinks its own; the others' that this rank created are theirs to unlink from here on."""
        unlink(self.path(self.rank))
        for rank in self._fds:
            untrack(self.path(rank))

    def ring(self, rank: int) -> None:
        fd = self._fds.get(rank)  # None once closed
        if fd is None:
            return
        try:
            os.write(fd, b"\0")
        except BlockingIOError:  # the pipe is full: it rings already
            pass

    def _drain(self) -> None:
        try:
            while len(os.read(self._mine, 4096)) == 4096:
                pass
        except BlockingIOError:
            pass

    def await_(self, ready: Callable[[], bool], what: str, peer: int, poll: float = POLL_S) -> None:
        """Sleep on this rank's doorbell until ``ready()``; ``check`` runs every 50 ms (no busy waiting).

        ``poll`` below 50 ms makes a wait look at ``ready()`` that often even when nobody rings (a sender
        waiting for an ack, which receivers do not ring for)."""
        if ready():
            return
        started = looked = time.perf_counter()
        while True:
            rung = self._poller.poll(poll * 1000.0)  # poll(), not select(): no limit on the fd number
            if rung:
                self._drain()
            if ready():
                return
            now = time.perf_counter()
            if (not rung and poll >= POLL_S) or now - looked >= POLL_S:  # a quiet interval, or often woken
                looked = now
                self.check(started, what, peer)

    def close(self) -> None:
        """Unlink this rank's doorbell (if still named) and close every doorbell's fd."""
        unlink(self.path(self.rank))
        for rank in self._fds:
            untrack(self.path(rank))
        for fd in self._fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds = {}
