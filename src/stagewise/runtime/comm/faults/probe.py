"""Evidence that a peer's process is gone, which a live peer - however slow, even stopped - cannot give.

Each process listens on a TCP port of its own for as long as it lives (:func:`listen`; opened once, its
address published by the heartbeat). A survivor whose collective failed connects to each peer's port
(:func:`refused`): the kernel of a live process's machine completes the handshake even when that process is
stopped or starved of CPU, so the connection is refused only when no process listens there any more - the
process has exited (killed, crashed, or ended). Nothing here depends on how long anyone waited.

Not evidence: a timeout or an unreachable network (a partitioned or powered-off machine: the heartbeat's
silence and the hang threshold decide those), and a port never reached from here (a firewall that refuses
every connection must not look like a dead peer: :class:`Probes` trusts a refusal only from a port it once
connected to). A port taken over by another process after the death makes the peer look alive, which only
costs the blame window (:func:`.heartbeat.blame_stopped`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import threading
import time

CONNECT_S = 0.5  # a probe's connect; a refusal comes back in a round trip
QUIET_S = 10.0  # a port that did not answer is not asked again for this long (each ask of a cut-off machine's
# port costs CONNECT_S and can bring no evidence: seen, a partition's failure, recovery and agreement each
# spent a second asking its two ports in turn)

_listener: socket.socket | None = None
_lock = threading.Lock()


def listen() -> int:
    """This process's port (opened on first use, on every interface; closed in a forked child, whose port would
    otherwise outlive its parent)."""
    global _listener
    with _lock:
        if _listener is None:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("0.0.0.0", 0))
            sock.listen(128)
            sock.setblocking(False)
            _listener = sock
        return int(_listener.getsockname()[1])


def _forget_in_child() -> None:
    global _listener
    if _listener is not None:
        with contextlib.suppress(OSError):
            _listener.close()
    _listener = None


os.register_at_fork(after_in_child=_forget_in_child)


def drain() -> None:
    """Close the probes that came in (the kernel queued them; called from the heartbeat's thread each beat)."""
    sock = _listener
    while sock is not None:
        try:
            conn, _ = sock.accept()
        except OSError:  # none waiting (or closed)
            return
        conn.close()


def address_towards(host: str, port: int) -> str:
    """This machine's address on the route to ``host`` (what a peer that reaches the store reaches here by)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((socket.gethostbyname(host), port or 9))  # no packet is sent: it only picks the route
            return str(s.getsockname()[0])
        except OSError:
            return "127.0.0.1"


def refused(address: str, timeout: float = CONNECT_S) -> bool | None:
    """Connect to ``address`` ("host:port"): True when refused (nothing listens: the process is gone), False
    when accepted, None for anything else (a timeout, an unreachable host: no evidence either way)."""
    host, port = address.rsplit(":", 1)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        try:
            s.connect((host, int(port)))
            return False
        except ConnectionRefusedError:
            return True
        except OSError as err:
            return True if err.errno == errno.ECONNREFUSED else None


class Probes:
    """The peers' ports, each trusted once it accepted a connection from here (:meth:`confirm`); what each probe
    got, last, is kept for the report a recovery carries (:meth:`report`)."""

    def __init__(self) -> None:
        self.reached: dict[int, str] = {}
        self.last: dict[int, tuple[str, str]] = {}  # rank -> (address, "accepted" | "refused" | "no answer")
        self.unanswered: dict[int, float] = {}  # rank -> when (time.monotonic()) its port last gave no answer

    def confirm(self, rank: int, address: str) -> bool:
        """Connect once to ``rank``'s published ``address``; remember it if accepted (True)."""
        if self._probe(rank, address) is False:
            self.reached[rank] = address
            return True
        return False

    def gone(self, ranks: list[int] | None = None) -> list[int]:
        """The ranks (of ``ranks``, default every one reached) whose trusted port now refuses: exited for sure.
        The ports are asked at once (a call costs one connect's time, not one per peer), but those that gave no
        answer in the last :data:`QUIET_S` seconds (unreachable: no evidence either way)."""
        todo = sorted(self.reached) if ranks is None else [r for r in ranks if r in self.reached]
        now = time.monotonic()
        todo = [r for r in todo if now - self.unanswered.get(r, -QUIET_S) >= QUIET_S]
        got: dict[int, bool | None] = {}
        if len(todo) == 1:
            got[todo[0]] = self._probe(todo[0], self.reached[todo[0]])
        else:
            asks = [threading.Thread(target=self._probe_into, args=(r, got), daemon=True) for r in todo]
            for t in asks:
                t.start()
            for t in asks:
                t.join()
        return [r for r in todo if got.get(r) is True]

    def _probe_into(self, rank: int, got: dict[int, bool | None]) -> None:
        got[rank] = self._probe(rank, self.reached[rank])

    def report(self) -> dict[int, str]:
        """By rank: where its port was probed and what the last probe got (``"10.0.0.2:4100 refused"``), and
        whether that port was ever reached from here (a refusal counts only then)."""
        return {
            r: f"{address} {got}" + ("" if r in self.reached else " (never reached: no evidence)")
            for r, (address, got) in sorted(self.last.items())
        }

    def _probe(self, rank: int, address: str) -> bool | None:
        got = refused(address)
        self.last[rank] = (address, {True: "refused", False: "accepted", None: "no answer"}[got])
        if got is None:
            self.unanswered[rank] = time.monotonic()
        else:
            self.unanswered.pop(rank, None)
        return got
