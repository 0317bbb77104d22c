"""The probe of a rank's share of a core (issue 49 item 4): a busy loop's CPU time over its wall time between its
first and last hold-off (whole periods of a quota), an emulated slowdown honoured as the interpreter does;
gathered from every rank."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch.distributed as dist

from stagewise.runtime.calibration import probe


class QuotaClock:
    """A fake thread clock and wall clock under a CFS quota: each look at the wall clock is one chunk of the loop
    (``chunk`` s of CPU); once a period's ``quota`` is spent, the wall jumps to the next period, whose quota is
    whole again. The loop begins ``phase`` s into a period with that period's quota unspent (the rank was waiting
    for its peers), as a probe does."""

    def __init__(self, share: float, phase: float, period: float = 0.01, chunk: float = 1e-4) -> None:
        self.quota, self.period, self.chunk = share * period, period, chunk
        self.wall, self.cpu, self.spent = 100 * period + phase, 0.0, 0.0

    def perf_counter(self) -> float:
        if self.spent + self.chunk > self.quota + 1e-12:  # held off until the next period
            self.wall = (self.wall // self.period + 1) * self.period
            self.spent = 0.0
        self.wall += self.chunk
        self.cpu += self.chunk
        self.spent += self.chunk
        return self.wall

    def thread_time(self) -> float:
        return self.cpu

    def sleep(self, seconds: float) -> None:
        self.wall += seconds


@pytest.mark.parametrize("share", [0.25, 0.5])
@pytest.mark.parametrize("phase", [0.0, 0.003, 0.0085])
def test_a_quota_reads_as_its_share_of_a_core(monkeypatch: pytest.MonkeyPatch, share: float, phase: float) -> None:
    """Between the first and last hold-off the window holds whole periods: the quota's share, wherever in its
    period the probe began."""
    monkeypatch.setattr(probe, "time", QuotaClock(share, phase))
    assert probe.core_share() == pytest.approx(share, abs=0.01)


@pytest.mark.parametrize("share", [0.25, 0.5])
def test_the_whole_loop_would_count_the_first_periods_leftover(share: float) -> None:
    """The mutant the window guards against: begun 2 ms into a period with its quota unspent, the whole loop
    reads more than a tenth above the quota."""
    assert probe.window_share(_looks(QuotaClock(share, 0.002)), []) > 1.1 * share


def _looks(clock: QuotaClock) -> list[tuple[float, float]]:
    start = clock.wall
    out = [(start, clock.cpu)]
    while out[-1][0] - start < probe.PROBE_S:
        out.append((clock.perf_counter(), clock.thread_time()))
    return out


def test_a_free_core_reads_whole_and_an_emulated_slowdown_its_inverse(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = QuotaClock(1.0, 0.0)
    monkeypatch.setattr(probe, "time", clock)
    assert probe.core_share() == pytest.approx(1.0, abs=1e-6)
    clock = QuotaClock(1.0, 0.0)
    monkeypatch.setattr(probe, "time", clock)
    assert probe.core_share(slowdown=4.0) == pytest.approx(0.25, abs=0.01)  # it sleeps 3 times the loop's time


def test_the_window_needs_two_hold_offs() -> None:
    looks = [(0.0, 0.0), (1.0, 1.0), (3.0, 1.5), (4.0, 2.5), (6.0, 3.0)]  # held off before looks 2 and 4
    assert probe.window_share(looks, [2, 4]) == pytest.approx((3.0 - 1.5) / (6.0 - 3.0))
    assert probe.window_share(looks, [2]) == pytest.approx(3.0 / 6.0)  # one hold-off: the whole loop


def test_every_rank_gets_every_rate() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        (share,) = probe.probe_shares(None)
        assert 0 < share <= 1
    finally:
        dist.destroy_process_group()


def test_a_replanner_refuses_a_negative_probe_interval() -> None:
    from stagewise.runtime import Replanner

    with pytest.raises(ValueError, match="probe_every"):
        Replanner(SimpleNamespace(num_ranks=2), SimpleNamespace(prior=None), steps=10, probe_every=-1)
