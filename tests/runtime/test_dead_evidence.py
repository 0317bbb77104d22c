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

from stagewise.runtime.comm import release
from stagewise.runtime.comm.faults import heartbeat, probe
from stagewise.runtime.elastic.membership import named_dead

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


def test_a_refusal_from_a_port_never_reached_is_no_evidence(peer: Any) -> None:
    proc, address = peer
    proc.kill()
    proc.wait()
    probes = probe.Probes()
    assert not probes.confirm(1, address)  # (a firewall refusing every probe looks the same: not trusted)
    assert probes.gone() == [] and probes.gone([1]) == []


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
