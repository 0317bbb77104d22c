"""snapshot_wire's point-to-point works, faked (the snapshot copy's give-up tests: tests/runtime/test_snapshot_*.py):
one that is done, and one that blocks until the test releases it, then fails as a closed connection does."""

from __future__ import annotations

import threading
from typing import Any


class Done:
    def wait(self, timeout: Any = None) -> bool:
        return True


class Blocked:
    """A peer's work that never ends by itself: ``release`` (an event the test sets) ends it, and then
    ``blocked_ended`` is set (a test asserts the exchange returned before it)."""

    def __init__(self, release: threading.Event, blocked_ended: threading.Event) -> None:
        self.release, self.blocked_ended = release, blocked_ended

    def wait(self, timeout: Any = None) -> bool:
        self.release.wait()  # (no timeout: only the test ends it)
        self.blocked_ended.set()
        raise RuntimeError("Connection closed by peer")


def install(monkeypatch: Any, wire: Any, made: list[Any]) -> Any:
    """``wire``'s ``irecv`` and ``isend`` in place of ``torch.distributed``'s for snapshot_wire, kept in ``made``
    (the fixture releases each at its end)."""
    from stagewise.runtime.comm import snapshot_wire

    monkeypatch.setattr(snapshot_wire.dist, "irecv", wire.irecv)
    monkeypatch.setattr(snapshot_wire.dist, "isend", wire.isend)
    made.append(wire)
    return wire
