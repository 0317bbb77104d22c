"""Who the shm transport's peers are: where each rank's process runs, whether it still lives, whether it can
use shared memory, and the refusal (alike on every rank) of a group the transport cannot serve.

Why a file of its own: choosing the transport (``choose.py``, ``transport="auto"``) needs only this, and the
liveness test (pid plus start time, so a reused pid is not taken for the peer) is what lets a waiting rank
fail fast, naming a dead peer, instead of sitting out its deadline.
"""

from __future__ import annotations

import os
import platform
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

SHM_DIR = "/dev/shm"
_TSO_MACHINES = {"x86_64", "amd64"}  # total store order: see shm_slots.py on memory order


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


def gather_peers(group: Any, wait: Callable[[Sequence[Any], str], None] | None = None) -> list[Peer]:
    """Every group rank's :class:`Peer` (a collective over ``group``: all ranks call it together), as JSON;
    ``wait``: a deadline-bounded wait that watches the error board (the pipeline guard's)."""
    from dataclasses import asdict

    from ..collectives import gather_json

    return [Peer(**d) for d in gather_json(asdict(Peer.here()), group, wait, "where every rank runs")]


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
