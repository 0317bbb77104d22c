"""A snapshot copy in flight to a stopped machine ends at the posted failure (issue 48 item 4, the SIGSTOP's time).

A stopped machine's kernel takes in the copy's length (the transfer has begun) and then nothing more: the
exchange waited for its bytes until its timeout, and the recovery's drop with it (7 of a SIGSTOP's 10.5 s in the
chaos of 2026-12-04). Once the run's failure is posted and the peer is known lost (its stamps stood still), the
begun transfer is given up too. The fake wire's stopped peer blocks until the test releases it; no clock is
read."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from helpers.fake_wire import Blocked, Done, install
from stagewise.runtime.comm import groups, snapshot_exchange
from stagewise.runtime.comm.faults import heartbeat
from stagewise.runtime.elastic import snapshot_copies


class _Stopped:
    """Point-to-point ops faked: every preamble goes through; ``stopped``'s bytes never do (until ``release``)."""

    def __init__(self, stopped: int) -> None:
        self.stopped, self.release, self.lock = stopped, threading.Event(), threading.Lock()
        self.lengths: dict[int, int] = {}  # by peer: the ops posted
        self.length_in = threading.Event()  # both peers' bytes posted: their preambles went through (begun)
        self.blocked_ended = threading.Event()

    def _op(self, t: torch.Tensor, peer: int) -> Any:
        with self.lock:
            n = self.lengths.get(peer, 0)
            self.lengths[peer] = n + 1
            if n == 0:
                if t.numel() > 3:  # (a receiver reads a preamble: one part of 3 bytes)
                    t.copy_(snapshot_exchange.preamble([torch.empty(3, dtype=torch.uint8)], b""))
                return Done()
            if sum(1 for k in self.lengths.values() if k > 1) == 2:
                self.length_in.set()  # (a transfer posts its bytes after it counted itself begun)
        if peer == self.stopped:
            return Blocked(self.release, self.blocked_ended)
        return Done()

    def irecv(self, t: torch.Tensor, group_src: int, group: Any) -> Any:
        return self._op(t, group_src)

    def isend(self, t: torch.Tensor, group_dst: int, group: Any) -> Any:
        return self._op(t, group_dst)


@pytest.fixture
def stopped(monkeypatch: pytest.MonkeyPatch) -> Any:
    made: list[_Stopped] = []

    def make(peer: int) -> _Stopped:
        return install(monkeypatch, _Stopped(peer), made)

    yield make
    for w in made:
        w.release.set()


def _exchange(dest: int, lost: Any, posted: threading.Event, out: dict[str, Any]) -> threading.Thread:
    def run() -> None:
        out["done"] = snapshot_exchange.exchange_settled(
            torch.arange(3, dtype=torch.uint8), dest, [2], None, 3600.0, give_up=posted.is_set, lost=lost
        )

    t = threading.Thread(target=run)
    t.start()
    return t


@pytest.mark.parametrize("peer", [0, 2], ids=["the dest stopped", "a source stopped"])
def test_a_begun_copy_with_a_lost_peer_is_given_up_at_the_posted_failure(stopped: Any, peer: int) -> None:
    """This rank sends to 0 and receives from 2; ``peer`` stopped after its length went through. Once the
    failure is posted and ``lost(peer)`` says so, the exchange returns while that peer's wait is still blocked:
    the other transfer ended whole, the stopped one is named."""
    w = stopped(peer)
    posted, out = threading.Event(), dict[str, Any]()
    asked: list[int] = []
    t = _exchange(0, lambda p: asked.append(p) or p == peer, posted, out)
    assert w.length_in.wait(60)
    posted.set()
    t.join(60)
    assert not t.is_alive() and not w.blocked_ended.is_set()  # returned while the stopped peer's wait blocks
    done = out["done"]
    other = 2 if peer == 0 else 0
    assert done.ended == {other}
    assert [str(e) for e in done.failed] == [
        f"group rank {peer} stopped or was cut off in the snapshots' copy: given up, the run failed"
    ]
    assert peer in asked


@pytest.mark.parametrize("lost", [lambda p: False, None], ids=["the peer not known lost", "no lost given"])
def test_a_begun_copy_is_waited_for_unless_its_peer_is_known_lost(stopped: Any, lost: Any) -> None:
    """The mutants' check: the failure posted, the stopped peer's length in, but nothing says it is lost - the
    exchange still waits for its bytes (a live peer's bytes come, and may be a committed step's only copy)."""
    w = stopped(0)
    posted, out = threading.Event(), dict[str, Any]()
    t = _exchange(0, lost, posted, out)
    assert w.length_in.wait(60)
    posted.set()
    t.join(0.5)
    assert t.is_alive()  # (a join that must not end: no bound on how fast it returns is asserted)
    w.release.set()
    t.join(60)
    assert not t.is_alive() and w.blocked_ended.is_set()
    assert [str(e) for e in out["done"].failed] == [
        "waiting for the snapshots' copies: RuntimeError: Connection closed by peer"
    ]


class _Snap:
    group = object()


def test_lost_maps_the_group_rank_to_the_global_one_and_reads_the_store_at_most_every_half_second(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``snapshot_copies._lost``: group rank 1 of a group of global ranks [4, 6] is global rank 6; the stamps are
    read once for several questions in a row (each read is a store round trip per rank)."""
    reads: list[float] = []
    monkeypatch.setattr(heartbeat, "lost_ranks", lambda silence=None: reads.append(silence) or {6})
    monkeypatch.setattr(groups, "global_ranks", lambda group: [4, 6])
    lost = snapshot_copies._lost(_Snap())
    assert [lost(1), lost(0), lost(1)] == [True, False, True]
    assert reads == [None]  # (the bound InPlace set: see test_dead_evidence)


def test_lost_says_nothing_without_evidence(monkeypatch: pytest.MonkeyPatch) -> None:
    """No rank known lost: no peer is, and the group is not even asked for its ranks (a fake snapshotter's
    group, or one already destroyed)."""
    monkeypatch.setattr(heartbeat, "lost_ranks", lambda silence=None: set())

    def no_group(group: Any) -> list[int]:
        raise AssertionError("the group's ranks asked for without evidence")

    monkeypatch.setattr(groups, "global_ranks", no_group)
    assert snapshot_copies._lost(_Snap())(0) is False
