"""The probe of a rank's share of a core (issue 49 item 4): a busy loop's CPU seconds over its wall seconds, an
emulated slowdown honoured; gathered from every rank."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from stagewise.runtime.calibration.probe import cpu_share, probe_shares


def test_an_emulated_slowdown_probes_at_most_its_share() -> None:
    """Sleeping (f - 1) x the loop's time after it (as the interpreter does) leaves at most 1 / f: the loop's CPU
    seconds never exceed its wall seconds, and a sleep never returns early."""
    assert cpu_share(0.005, slowdown=4.0) <= 0.25 + 1e-9
    assert 0.0 < cpu_share(0.005) <= 1.0


def test_every_rank_gets_every_share() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        (share,) = probe_shares(None, slowdown=2.0)
        assert 0.0 < share <= 0.5 + 1e-9
    finally:
        dist.destroy_process_group()


def test_a_replanner_refuses_a_negative_probe_interval() -> None:
    from types import SimpleNamespace

    from stagewise.runtime import Replanner

    with pytest.raises(ValueError, match="probe_every"):
        Replanner(SimpleNamespace(num_ranks=2), SimpleNamespace(prior=None), steps=10, probe_every=-1)
