"""Asking cut-off peers' ports (issue 48 item 4, the partition's p50): a call asks every port at once, and a port
that gave no answer is not asked again for a while. A partition's failure, its recovery and its agreement each
asked a cut-off machine's two ports in turn (a connect's timeout each): a second apiece. Fake ports, a fake
clock: what is asked, and together, never how long."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from stagewise.runtime.comm.faults import probe


@pytest.fixture
def ports(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Ports 1 and 2 do not answer (a cut-off machine), port 3 refuses; each unanswered ask returns only once
    both unanswered ports are being asked (a barrier: asked in turn, the first never returns)."""
    asked: list[str] = []
    both = threading.Barrier(2, timeout=30)
    clock = [1000.0]

    def refused(address: str, timeout: float = probe.CONNECT_S) -> bool | None:
        asked.append(address)
        if address == "h:3":
            return True
        try:
            both.wait()
        except threading.BrokenBarrierError:
            return False  # (asked one after the other: "accepted", which the test refuses)
        return None

    monkeypatch.setattr(probe, "refused", refused)
    monkeypatch.setattr(probe.time, "monotonic", lambda: clock[0])
    probes = probe.Probes()
    probes.reached = {1: "h:1", 2: "h:2", 3: "h:3"}
    return probes, asked, both, clock


def test_the_ports_are_asked_together_and_an_unanswered_one_is_not_asked_again_at_once(ports: Any) -> None:
    probes, asked, both, clock = ports
    assert probes.gone() == [3]
    assert sorted(asked) == ["h:1", "h:2", "h:3"] and not both.broken  # 1 and 2 were asked together
    assert probes.report() == {1: "h:1 no answer", 2: "h:2 no answer", 3: "h:3 refused"}
    asked.clear()
    clock[0] += probe.QUIET_S / 2
    assert probes.gone() == [3] and asked == ["h:3"]  # the unanswered ports are left alone a while
    clock[0] += probe.QUIET_S
    assert probes.gone([1, 2]) == [] and sorted(asked) == ["h:1", "h:2", "h:3"]  # then asked again
