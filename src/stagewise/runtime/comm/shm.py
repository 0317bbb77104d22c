"""A same-host transport: boundary values through shared memory, doorbells through named pipes.

Why: a gloo message on loopback costs ~170 us (a socket round trip plus
gloo's own I/O threads), which caps the efficiency of schedules that send
many small messages. Ranks on one host can instead copy each value into a
shared buffer and wake the receiver with one byte.

What goes where. Only the steady state moves through shared memory: the
schedule's batched point-to-point (:meth:`ShmTransport.post`), whose shapes
both ends know. Everything else goes through an inner
:class:`~.torch_p2p.TorchTransport` on the same group, unchanged: first
exchanges and variable shapes (``post_eager``), the loss broadcast, the
collectives of the hybrid axes, the error board, deadlines and forensics.

The protocol (:class:`Channels`):

* *Slots*: one file in ``/dev/shm`` per (sender, receiver, tag, k, bytes),
  where k is the op's index among the ops with that tag in one post (a value
  with several tensors sends several). Header: ``seq`` (values written, by the
  sender) and ``ack`` (values taken, by the receiver); then the bytes. Both
  sides open it with ``O_CREAT`` and ``ftruncate`` it to the same size, so
  whichever comes first creates it and neither can clobber the other. Names
  carry a nonce drawn by group rank 0 when the transport is built, so runs and
  pipelines never share a slot.
* *Send* of a slot's n-th value: wait until ``ack >= n - 1`` (the previous
  value was taken; it only waits when the sender is a whole step ahead), copy
  the bytes in, set ``seq = n``, ring the receiver's doorbell. The send is
  complete when ``post`` returns: the sender's tensor may be reused at once.
* *Receive* of the n-th value: wait until ``seq >= n``, copy the bytes out,
  set ``ack = n``. The sender's doorbell is not rung: a sender waits for an
  ack only when it is a whole step ahead, and then it looks every 1 ms;
  ringing would wake it for nothing on most messages (measured: a wake-up
  per message costs more CPU than the copy).
* *Doorbells*: one named pipe (FIFO) per rank, opened read-write and
  non-blocking by everyone; ringing writes one byte (a full pipe already
  rings). A waiter sleeps in ``poll`` on its own doorbell (no spinning: on
  a 2-core machine a spinning rank steals its neighbour's core), re-checks its
  condition on every wake-up, and every 50 ms of quiet looks at the error
  board, the deadline and whether the peer's process is still alive (pids and
  start times are exchanged when the transport is built; a dead or zombie peer
  fails the wait naming its rank and pid, before any timeout).

Memory order: the sender stores the bytes, then ``seq``; the receiver loads
``seq``, then the bytes. On x86-64 (total store order) stores are seen in
program order and loads are not reordered with older loads, so a receiver
that sees ``seq = n`` sees the value's bytes; the same holds for ``ack`` and
the slot's reuse. Weaker CPUs would need fences that Python cannot issue, so
this transport refuses to run elsewhere (``auto`` picks torch there).

Names in /dev/shm live only as long as needed, so that a process that ends
without cleaning up (``os._exit``, a signal) leaves little behind: every
rank opens every doorbell when the transport is built, and after a barrier
each unlinks its own; a receiver unlinks a slot once it has taken the
slot's first value (the sender has it mapped by then). What is left (slots
never used to the end) goes when the transport closes. A failure ends the
pipeline: every rank unlinks every file of the pipeline it finds as soon as
it learns of it (a failed rank may end with ``os._exit``). Only a failure no
surviving rank learns of (all killed) leaves files behind (``/dev/shm/sw-*``).
"""

from __future__ import annotations

import contextlib
import glob
import mmap
import os
import platform
import select
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ..errors import PipelineError
from .groups import backend_of
from .torch_p2p import TorchTransport
from .transport import Op, TransportSpec
from .waits import Watch

T = TypeVar("T")

SHM_DIR = "/dev/shm"
_HEADER = 64  # seq and ack (int64 each), padded so the bytes start aligned
_POLL_S = 0.05  # how long a wait sleeps before it looks at the board, the clock and the peer
_ACK_POLL_S = 0.001  # a sender waiting for a slot to be taken is not rung: it looks this often
_TSO_MACHINES = {"x86_64", "amd64"}

#: raises PipelineError when a wait for ``peer`` must stop: (started, what, peer) -> None
Checker = Callable[[float, str, int], None]


# ---- who the peers are -------------------------------------------------------------------
@dataclass(frozen=True)
class Peer:
    """One rank's process as the others see it: where it runs, and how to tell whether it still lives."""

    host: str
    boot_id: str
    pid: int
    start: str  # the process's start time (clock ticks since boot), so a reused pid is not taken for it
    capable: bool  # it can use this transport (x86-64, a writable /dev/shm)
    nonce: str
    namespaces: str = ""  # pid and mount namespaces: containers on one kernel may see other pids and /dev/shm

    @classmethod
    def here(cls) -> Peer:
        pid = os.getpid()
        return cls(
            socket.gethostname(), _boot_id(), pid, _start_time(pid) or "", _capable(), os.urandom(6).hex(), _spaces()
        )

    def where(self) -> tuple[str, str, str]:
        return self.host, self.boot_id, self.namespaces

    def alive(self) -> bool:
        """False once the process has exited (a zombie counts as exited) or its pid belongs to another process."""
        start = _start_time(self.pid)
        return start is not None and (not self.start or start == self.start)


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _start_time(pid: int) -> str | None:
    """The process's start time from /proc, or None if it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2 :].split()  # the command name may hold spaces and parentheses
    if not fields or fields[0] in ("Z", "X", "x"):
        return None
    return fields[19] if len(fields) > 19 else ""


def _spaces() -> str:
    try:
        return os.readlink("/proc/self/ns/pid") + os.readlink("/proc/self/ns/mnt")
    except OSError:
        return ""


def _capable() -> bool:
    return platform.machine().lower() in _TSO_MACHINES and os.access(SHM_DIR, os.W_OK) and hasattr(os, "mkfifo")


def same_host(peers: Sequence[Peer]) -> bool:
    """Whether every peer runs on this machine's kernel (same host name, boot, pid and mount namespaces) and can
    use shared memory."""
    first = peers[0]
    return bool(first.boot_id) and all(p.capable and p.where() == first.where() for p in peers)


def gather_peers(group: Any, wait: Callable[[list[Any], str], None] | None = None) -> list[Peer]:
    """Every group rank's :class:`Peer` (a collective over ``group``: all ranks call it together), as JSON;
    ``wait``: a deadline-bounded wait that watches the error board (a transport's)."""
    from dataclasses import asdict

    from .collectives import gather_json

    return [Peer(**d) for d in gather_json(asdict(Peer.here()), group, wait, "where every rank runs")]


# ---- slots and doorbells ----------------------------------------------------------------
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
    _bells: dict[int, int] = field(default_factory=dict)  # rank -> fd

    def __post_init__(self) -> None:
        for rank in range(self.size):  # every doorbell, now: see forget_names
            self._open_bell(rank)
        self._bell = self._bells[self.rank]
        self._poller = select.poll()
        self._poller.register(self._bell, select.POLLIN)

    def forget_names(self) -> None:
        """Unlink this rank's doorbell from /dev/shm: call once every rank has opened every doorbell (a barrier)."""
        _unlink(f"{self.prefix}-bell{self.rank}")

    # -- doorbells
    def _open_bell(self, rank: int) -> int:
        fd = self._bells.get(rank)
        if fd is None:
            path = f"{self.prefix}-bell{rank}"
            try:
                os.mkfifo(path, 0o600)
            except FileExistsError:
                pass
            fd = self._bells[rank] = os.open(path, os.O_RDWR | os.O_NONBLOCK)  # RDWR: never blocks, never ENXIO
        return fd

    def ring(self, rank: int) -> None:
        fd = self._bells.get(rank)  # None once closed
        if fd is None:
            return
        try:
            os.write(fd, b"\0")
        except BlockingIOError:  # the pipe is full: it rings already
            pass

    def _drain(self) -> None:
        try:
            while len(os.read(self._bell, 4096)) == 4096:
                pass
        except BlockingIOError:
            pass

    def await_(self, ready: Callable[[], bool], what: str, peer: int, poll: float = _POLL_S) -> None:
        """Sleep on this rank's doorbell until ``ready()``; ``check`` runs every 50 ms (no busy waiting)."""
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
            if (not rung and poll >= _POLL_S) or now - looked >= _POLL_S:  # a quiet interval, or often woken
                looked = now
                self.check(started, what, peer)

    # -- slots
    def slot(self, src: int, dst: int, tag: int, k: int, nbytes: int) -> _Slot:
        key = (src, dst, tag, k, nbytes)
        found = self._slots.get(key)
        if found is None:
            path = f"{self.prefix}-{src}-{dst}-{tag}-{k}-{nbytes}"
            fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
            try:
                size = _HEADER + max(nbytes, 8)
                os.ftruncate(fd, size)  # both sides, same size: whoever comes second changes nothing
                mm = mmap.mmap(fd, size)
            finally:
                os.close(fd)
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
            self.await_(lambda: header[1] >= n - 1, what, peer, _ACK_POLL_S)
        if slot.nbytes:
            slot.data.copy_(raw)
        header[0] = n  # after the bytes (see the module docstring on memory order)

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
            self.await_(lambda: header[0] >= n, what, work.slot.peer)
        slot = work.slot
        if slot.nbytes:
            _bytes_of(work.tensor).copy_(slot.data)
        header[1] = n  # no ring: a sender rarely waits for this (only a whole step ahead), and then it polls
        work.done = True
        if slot.linked:  # the sender wrote it, so both sides hold the mapping: the name has served
            slot.linked = False
            _unlink(slot.path)

    def unlink_all(self) -> None:
        """After a failure: unlink every file of the pipeline found in /dev/shm (a dead peer's included)."""
        for path in glob.glob(glob.escape(self.prefix) + "-*"):
            _unlink(path)
        for slot in self._slots.values():
            slot.linked = False

    def close(self, everything: bool) -> None:
        """Unlink this rank's slots as a receiver and its doorbell (with ``everything``: all the pipeline's files)."""
        if everything:
            self.unlink_all()
        for slot in self._slots.values():
            if slot.receiving and slot.linked:
                _unlink(slot.path)
        _unlink(f"{self.prefix}-bell{self.rank}")
        for fd in self._bells.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self._slots, self._bells = {}, {}  # the mappings go with their last tensor view


_EMPTY = torch.empty(0, dtype=torch.uint8)


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous CPU tensor (writes through it land in ``t``)."""
    return t.reshape(-1).view(torch.uint8)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:  # gone already (the peer unlinked it), or nothing more to do
        pass


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
        with self._guard():
            self.inner.broadcast(tensor, src, what)

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


def _mine(work: Any) -> bool:
    return isinstance(work, (ShmWork, _Sent))


def check_shm_group(backend: str, peers: Sequence[Peer]) -> None:
    """Refuse, alike on every rank (the peers were gathered), a group the shm transport cannot serve."""
    if backend != "gloo":
        raise ValueError(
            f"transport='shm' needs a gloo process group (CPU); this pipeline's group uses {backend!r} "
            "(use transport='torch' or 'auto')"
        )
    first = peers[0]
    away = [r for r, p in enumerate(peers) if p.where() != first.where()]
    if away or not first.boot_id:
        raise ValueError(
            f"transport='shm' needs every rank of the pipeline on one host; group ranks {away} run elsewhere than "
            f"rank 0 (host {first.host!r}) (use transport='torch' or 'auto')"
        )
    unable = [r for r, p in enumerate(peers) if not p.capable]
    if unable:
        raise ValueError(
            f"transport='shm' needs x86-64 Linux with a writable {SHM_DIR}; group ranks {unable} lack it "
            "(use transport='torch' or 'auto')"
        )


def shm_transport(spec: TransportSpec) -> ShmTransport:
    """The shared-memory transport: every rank of ``spec.group`` must be on this host (a collective)."""
    backend = backend_of(spec.group)
    if backend != "gloo":  # alike on every rank: refuse before any collective
        check_shm_group(backend, [Peer.here()])
    inner = TorchTransport(spec)  # its error board and deadline watch the gather
    peers = gather_peers(spec.group, inner.wait)
    check_shm_group(backend, peers)
    return ShmTransport(spec, peers, inner)
