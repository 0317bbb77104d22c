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


class Rank:
    """A fake group for :class:`Loop`: it names the rank whose thread passes it."""

    def __init__(self, rank: int) -> None:
        self.rank = rank


class _LoopWork:
    def __init__(self, loop: Loop, me: int, what: tuple[str, int, int]) -> None:
        self.loop, self.me, self.what = loop, me, what
        self.ended, self.failure = threading.Event(), ""

    def wait(self, timeout: Any = None) -> bool:
        with self.loop.cv:
            self.loop.events[self.me].append(("wait " + self.what[0], self.what[1], self.what[2]))
        seconds = timeout.total_seconds() if timeout is not None else None
        if not self.ended.wait(seconds):
            raise RuntimeError(f"Timed out waiting {seconds} s for {self.what[0]} with rank {self.what[1]}")
        if self.failure:
            raise RuntimeError(self.failure)
        return True


class Loop:
    """Ranks' point-to-point in one process (the group passed is a :class:`Rank`: the caller), matched as gloo
    matches them: per sender and receiver, in the order posted; a message lands at the start of its receive's
    buffer, and one longer than that buffer fails both ends. ``events[rank]``: what it posted and waited for."""

    def __init__(self) -> None:
        self.cv = threading.Condition()
        self.sends: dict[tuple[int, int], list[tuple[Any, _LoopWork]]] = {}
        self.recvs: dict[tuple[int, int], list[tuple[Any, _LoopWork]]] = {}
        self.events: dict[int, list[tuple[str, int, int]]] = {}

    def isend(self, t: Any, group_dst: int, group: Rank) -> _LoopWork:
        return self._post("send", group.rank, group_dst, (group.rank, group_dst), t.clone())

    def irecv(self, t: Any, group_src: int, group: Rank) -> _LoopWork:
        return self._post("recv", group.rank, group_src, (group_src, group.rank), t)

    def _post(self, kind: str, me: int, peer: int, key: tuple[int, int], t: Any) -> _LoopWork:
        work = _LoopWork(self, me, (kind, peer, t.numel()))
        with self.cv:
            self.events.setdefault(me, []).append(("post " + kind, peer, t.numel()))
            (self.sends if kind == "send" else self.recvs).setdefault(key, []).append((t, work))
            sends, recvs = self.sends.get(key, []), self.recvs.get(key, [])
            while sends and recvs:
                (data, sent), (buf, got) = sends.pop(0), recvs.pop(0)
                if data.numel() > buf.numel():
                    sent.failure = got.failure = f"a message of {data.numel()} bytes into {buf.numel()}"
                else:
                    buf[: data.numel()].copy_(data)
                sent.ended.set()
                got.ended.set()
        return work
