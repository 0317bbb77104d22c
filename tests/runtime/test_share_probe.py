"""The probe of a rank's share of a core (issue 49 item 4): a busy loop's iterations per wall second, an emulated
slowdown honoured as the interpreter does; gathered from every rank."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from stagewise.runtime.calibration import probe


def test_an_emulated_slowdown_sleeps_its_share_after_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """Slowed 4x, the loop then sleeps 3 times its own time (no CPU taken), as an emulated action does."""
    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)
    assert probe.loop_rate(0.005, slowdown=4.0) > 0
    assert len(slept) == 1 and slept[0] >= 3 * 0.005
    assert probe.loop_rate(0.005) > 0 and len(slept) == 1  # not slowed: no sleep


def test_every_rank_gets_every_rate() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        (rate,) = probe.probe_shares(None)
        assert rate > 0
    finally:
        dist.destroy_process_group()


def test_a_replanner_refuses_a_negative_probe_interval() -> None:
    from stagewise.runtime import Replanner

    with pytest.raises(ValueError, match="probe_every"):
        Replanner(SimpleNamespace(num_ranks=2), SimpleNamespace(prior=None), steps=10, probe_every=-1)
