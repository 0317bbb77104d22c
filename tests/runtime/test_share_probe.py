"""The probe of a rank's share of a core (issue 49 item 4): a busy loop's CPU time over its wall time between its
first and last hold-off (whole periods of a quota), an emulated slowdown honoured as the interpreter does;
gathered from every rank."""

from __future__ import annotations

from pathlib import Path
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


def _group(root: Path, path: str, quota: str, period: str) -> None:
    """A cgroup v1 cpu group under ``root`` with its quota and period."""
    d = root / path
    d.mkdir(parents=True, exist_ok=True)
    (d / "cpu.cfs_quota_us").write_text(quota)
    (d / "cpu.cfs_period_us").write_text(period)


def test_the_quota_is_read_from_the_group_and_its_ancestors_v1(tmp_path: Path) -> None:
    """cgroup v1: the least quota / period over the group and its ancestors; -1 sets none; a share of one core at
    most; the same tree as /proc/self/cgroup names it."""
    mount = "cpu,cpuacct"
    _group(tmp_path, mount, "-1", "100000")
    _group(tmp_path, f"{mount}/job", "300000", "100000")
    _group(tmp_path, f"{mount}/job/rank1", "2500", "10000")
    text = "9:name=systemd:/\n4:cpu,cpuacct:/job/rank1\n2:pids:/\n"
    assert probe.quota_share(text, tmp_path) == 0.25
    assert probe.quota_share(text.replace("/job/rank1", "/job"), tmp_path) == 1.0  # 3 cores: a whole one
    _group(tmp_path, f"{mount}/job", "5000", "10000")
    assert probe.quota_share(text.replace("/job/rank1", "/job"), tmp_path) == 0.5
    assert probe.quota_share(text, tmp_path) == 0.25  # the child's is less
    assert probe.quota_share("9:name=systemd:/\n", tmp_path) is None  # no cpu controller: unknown, not free


def test_the_quota_is_read_from_cpu_max_v2(tmp_path: Path) -> None:
    """cgroup v2: ``cpu.max`` of the group and its ancestors, ``max`` setting none."""
    (tmp_path / "cgroup.controllers").write_text("cpu io memory\n")
    (tmp_path / "cpu.max").write_text("max 100000\n")
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "cpu.max").write_text("max 100000\n")
    (tmp_path / "a" / "b" / "cpu.max").write_text("50000 100000\n")
    assert probe.quota_share("0::/a/b\n", tmp_path) == 0.5
    assert probe.quota_share("0::/a\n", tmp_path) == 1.0


def test_the_probes_wait_through_the_guard_the_pipeline_has_now() -> None:
    """A re-layout gives the pipeline a new transport and closes the old one's guard: the probes look the guard up
    at each call (one kept from the start failed on its torn-down board after the first re-layout, 2026-12-04)."""
    first, second = SimpleNamespace(wait=lambda works, what: None), SimpleNamespace(wait=lambda works, what: None)
    pipe = SimpleNamespace(transport=SimpleNamespace(guard=first))
    assert probe.pipeline_wait(pipe) is first.wait
    pipe.transport = SimpleNamespace(guard=second)  # re-laid out
    assert probe.pipeline_wait(pipe) is second.wait
    assert probe.pipeline_wait(SimpleNamespace()) is None  # no transport: a plain wait
