"""Naming a dead peer from evidence, never a live one (issue 48 item 4): the liveness ports, the blame that reads
them first and the window after, and a failed pipeline let go off the recovery path."""

from __future__ import annotations

import gc
import signal
import subprocess
import sys
import threading
import time
import weakref
from typing import Any

import pytest
import torch

from stagewise.runtime.comm import release, snapshot_exchange
from stagewise.runtime.comm.faults import heartbeat, probe
from stagewise.runtime.elastic.membership import named_dead
from stagewise.runtime.errors import PipelineError

_PEER = "import socket, sys, time; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(8); " \
    "print(s.getsockname()[1], flush=True); time.sleep(600)"  # fmt: skip


@pytest.fixture
def peer() -> Any:
    """A live process listening on a port of its own, as every stagewise process does."""
    proc = subprocess.Popen([sys.executable, "-c", _PEER], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    port = int(proc.stdout.readline())
    yield proc, f"127.0.0.1:{port}"
    proc.kill()
    proc.wait()


def test_a_stopped_peer_is_not_gone_and_a_killed_one_is(peer: Any) -> None:
    proc, address = peer
    probes = probe.Probes()
    assert probes.confirm(1, address)
    proc.send_signal(signal.SIGSTOP)  # stopped: the kernel still completes the handshake
    assert probe.refused(address) is False and probes.gone() == []
    proc.send_signal(signal.SIGCONT)
    proc.kill()
    proc.wait()
    assert probe.refused(address) is True and probes.gone() == [1]
    assert probes.report() == {1: f"{address} refused"}  # what a recovery's record says it probed, and got


def test_a_refusal_from_a_port_never_reached_is_no_evidence(peer: Any) -> None:
    proc, address = peer
    proc.kill()
    proc.wait()
    probes = probe.Probes()
    assert not probes.confirm(1, address)  # (a firewall refusing every probe looks the same: not trusted)
    assert probes.gone() == [] and probes.gone([1]) == []
    assert probes.report() == {1: f"{address} refused (never reached: no evidence)"}


def test_own_port_takes_probes_in_and_closes_them() -> None:
    port = probe.listen()
    assert probe.listen() == port  # one per process
    for _ in range(3):
        assert probe.refused(f"127.0.0.1:{port}") is False
    probe.drain()  # the kernel's queue emptied, the connections closed
    assert probe.refused(f"127.0.0.1:{port}") is False


def _gone_world(monkeypatch: pytest.MonkeyPatch, gone: list[int]) -> list[float]:
    """heartbeat as on global rank 0 of 3, with ``gone`` refusing; returns the windows waited."""
    probes = probe.Probes()
    probes.reached = {1: "127.0.0.1:1", 2: "127.0.0.1:2"}
    monkeypatch.setattr(probes, "gone", lambda ranks=None: list(gone))
    monkeypatch.setattr(heartbeat, "_probes", probes)
    monkeypatch.setattr(heartbeat.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(heartbeat.dist, "get_world_size", lambda: 3)
    waited: list[float] = []
    monkeypatch.setattr(heartbeat, "stopped_ranks", lambda within: waited.append(within) or [2])
    monkeypatch.setattr(heartbeat, "silent_ranks", lambda threshold: [])
    return waited


def test_the_blame_names_the_gone_peer_without_the_window(monkeypatch: pytest.MonkeyPatch) -> None:
    waited = _gone_world(monkeypatch, [1])
    text = heartbeat.blame_failed(10.0)
    assert waited == []  # no window: the evidence was enough
    assert text.startswith("global rank 1 stopped or died (process gone")
    assert named_dead(f"{text}: rank 2: the all-reduce failed", [10, 11, 12]) == [11]  # the membership reads it
    # the failure named one; by the agreement the port of another refuses too (a machine's processes die in turn)
    assert named_dead(f"{text} global rank 2 stopped or died (process gone: ...)", [10, 11, 12]) == [11, 12]


def test_a_peer_silent_past_half_the_timeout_is_named_without_the_window(monkeypatch: pytest.MonkeyPatch) -> None:
    waited = _gone_world(monkeypatch, [])  # stopped or cut off: its port still answers (or nothing does)
    monkeypatch.setattr(heartbeat, "silent_ranks", lambda threshold: [(1, 2 * threshold)])
    text = heartbeat.blame_failed(10.0)  # gloo's own timeout ended the op
    assert waited == [] and text.startswith("global rank 1 stopped or died (no sign of life")
    assert named_dead(text, [10, 11, 12]) == [11]


def test_without_evidence_the_blame_waits_out_the_window(monkeypatch: pytest.MonkeyPatch) -> None:
    waited = _gone_world(monkeypatch, [])
    text = heartbeat.blame_failed(10.0)
    assert waited == [2.5 * heartbeat.INTERVAL_S]
    assert named_dead(text, [10, 11, 12]) == [12]


def test_a_port_that_refuses_during_the_window_ends_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A killed process's sockets close one by one: gloo's connection may fail before the port refuses. The
    window then asks the ports again, and names the gone peer by them (not "no sign of life" for the window)."""
    probes, asked = probe.Probes(), list[int]()
    probes.reached = {1: "127.0.0.1:1", 2: "127.0.0.1:2"}
    monkeypatch.setattr(probes, "gone", lambda ranks=None: asked.append(1) or ([1] if len(asked) >= 3 else []))
    monkeypatch.setattr(heartbeat, "_probes", probes)
    monkeypatch.setattr(heartbeat, "_store", object())
    monkeypatch.setattr(heartbeat, "_stamps", lambda: {0: "1.0", 1: "1.0", 2: "1.0"})  # (no stamp moves)
    monkeypatch.setattr(heartbeat.dist, "get_rank", lambda: 0)
    text = heartbeat.blame_stopped(5.0)
    assert text.startswith("global rank 1 stopped or died (process gone"), text
    assert named_dead(text, [10, 11, 12]) == [11]


def test_a_failed_generation_is_posted_for_every_board_of_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks of another pipeline share no board with the one that failed: the run's job key reaches them all."""
    import torch.distributed as dist

    monkeypatch.setattr(heartbeat, "_store", dist.HashStore())
    assert heartbeat.job_failure() is None
    heartbeat.post_failure("global rank 0 stopped or died (process gone: ...): rank 3: ...")
    heartbeat.post_failure("rank 4: the all-reduce timed out")  # the first one stands
    assert heartbeat.job_failure() == "global rank 0 stopped or died (process gone: ...): rank 3: ..."
    heartbeat.stop()  # (posted in this process: a later test's exchange would give up at once)


class _Group:
    pass


def _group_like(names: list[str]) -> tuple[Any, weakref.ref[Any]]:
    group = _Group()  # (what is held is a failed generation's process groups and stores: no reference cycle)
    weakref.finalize(group, lambda: names.append(threading.current_thread().name))
    return group, weakref.ref(group)


def test_dropped_groups_are_held_then_let_go_on_the_release_thread() -> None:
    names: list[str] = []
    kept, kept_ref = _group_like(names)
    due, due_ref = _group_like(names)
    release.hold([(kept, None)], 3600.0)  # (a group timeout that has not passed)
    release.hold([(due, None)], 0.0)
    del kept, due
    end = time.monotonic() + 60
    while not names and time.monotonic() < end:
        time.sleep(0.05)
    gc.collect()  # the caller's collections do not free what is held
    assert due_ref() is None and names == ["stagewise-release"]  # its destructor ran there, not here
    assert kept_ref() is not None and release.held() >= 1


class _Work:
    def __init__(self, failure: str | None) -> None:
        self.failure = failure

    def wait(self, timeout: Any = None) -> bool:
        if self.failure:
            raise RuntimeError(self.failure)
        return True


#: one part's preamble: its length, the form, the note's length, the note's room (snapshot_exchange.preamble)
PREAMBLE = snapshot_exchange.preamble_size(1)


def _wire(monkeypatch: pytest.MonkeyPatch, dead: int) -> list[tuple[str, int, int]]:
    """snapshot_wire's point-to-point ops, faked: ``dead``'s connection is closed, every other peer sends 3 bytes
    (its preamble says so, then the bytes are 7s)."""
    posted: list[tuple[str, int, int]] = []
    said = snapshot_exchange.preamble([torch.zeros(3, dtype=torch.uint8)], b"")

    def irecv(t: torch.Tensor, group_src: int, group: Any) -> _Work:
        posted.append(("recv", group_src, t.numel()))
        t.copy_(said) if t.numel() == PREAMBLE else t.fill_(7)
        return _Work("Connection closed by peer" if group_src == dead else None)

    def isend(t: torch.Tensor, group_dst: int, group: Any) -> _Work:
        posted.append(("send", group_dst, t.numel()))
        return _Work("Connection reset by peer" if group_dst == dead else None)

    monkeypatch.setattr(snapshot_exchange.dist, "irecv", irecv)
    monkeypatch.setattr(snapshot_exchange.dist, "isend", isend)
    return posted


def test_a_dead_source_does_not_stop_the_copy_to_the_next_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three machines in a ring, the middle one killed: its next survivor still sends its copy on (else the one
    after that waits the whole timeout for it, and the recovery with it), and that one takes it in."""
    payload = torch.arange(3, dtype=torch.uint8)
    posted = _wire(monkeypatch, dead=2)  # as rank 4: its source (rank 2) is gone, its dest (rank 0) is not
    with pytest.raises(PipelineError, match="Connection closed by peer"):
        snapshot_exchange.exchange(payload, 0, [2], None, 10.0)
    assert sorted(posted) == [("recv", 2, PREAMBLE), ("send", 0, 3), ("send", 0, PREAMBLE)]  # the preamble, the bytes
    assert [p for p in posted if p[0] == "send"] == [("send", 0, PREAMBLE), ("send", 0, 3)]  # (each peer's in order)
    posted = _wire(monkeypatch, dead=2)  # as rank 0: its dest (rank 2) is gone; rank 4's copy comes in whole
    keep: dict[int, torch.Tensor] = {}
    with pytest.raises(PipelineError, match="Connection reset by peer"):
        snapshot_exchange.exchange(payload, 2, [4], None, 10.0, into=keep)
    assert [p for p in posted if p[1] == 4] == [("recv", 4, PREAMBLE), ("recv", 4, 3)] and keep[4].tolist() == [7] * 3
    assert [p for p in posted if p[1] == 2] == [("send", 2, PREAMBLE), ("send", 2, 3)]  # (all at once, in order)


def test_lost_ranks_wait_the_silence_inplace_set_and_never_name_a_rank_that_never_stamped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``lost_ranks()``: the bound is ``InPlace(silence_s=)`` (a job that raised it on oversubscribed cores gives up
    no live peer's copy sooner), and a rank with no stamp yet (a corner just made) is no evidence of loss."""
    import torch.distributed as dist

    store = dist.HashStore()
    now = time.time()
    store.set("alive/1", str(now - 5.0))  # silent 5 s
    store.set("alive/2", str(now - 0.2))  # alive; rank 3 never stamped
    probes = probe.Probes()
    monkeypatch.setattr(probes, "gone", lambda ranks=None: [])
    monkeypatch.setattr(heartbeat, "_probes", probes)
    monkeypatch.setattr(heartbeat, "_store", store)
    monkeypatch.setattr(heartbeat.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(heartbeat.dist, "get_world_size", lambda: 4)
    monkeypatch.setattr(heartbeat, "_lost_silence_s", 3.0)
    assert heartbeat.lost_ranks() == {1}
    heartbeat.set_lost_silence(8.0)
    assert heartbeat.lost_ranks() == set()
    assert heartbeat.lost_ranks(4.0) == {1}
