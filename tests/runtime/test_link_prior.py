"""The link fit's default prior bandwidth (issue 49 item 2): the link a pipeline's plan was searched with, or a
probe's, kept where the run's transfers (one message size) cannot identify a bandwidth; infinite, and said,
when none is known. Simulated timelines, no processes."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest

import stagewise as sw
from helpers.profiles import fake_profile
from stagewise import build_schedule, simulate
from stagewise.planning import Calibration, Link
from stagewise.runtime import RunCalibrator
from stagewise.runtime.calibration.from_run import link_prior

PRIOR = fake_profile([1.0] * 8, acts=[64.0] * 8)  # every boundary sends the same bytes: one size
LINK = Link(0.01, 2048.0)


def fake_pipe(plan: Any = None) -> SimpleNamespace:
    """What the calibrator reads of a pipeline: 1F1B at 2 ranks over 8 equal layers, built from ``plan``."""
    return SimpleNamespace(
        schedule=build_schedule("1f1b", 2, 4), layer_ranges=[range(0, 4), range(4, 8)], layer_profile=PRIOR,
        num_ranks=2, rank=0, frontend=SimpleNamespace(plan=plan) if plan is not None else object(),
    )  # fmt: skip


def calibrated(calibrator: RunCalibrator) -> dict[str, Any]:
    """Four steps of the plan simulated over :data:`LINK` (one warm-up, three calibrating): the record."""
    run = simulate(
        calibrator.pipe.schedule, PRIOR.cost_model([0, 4, 8], latency=LINK.latency, bandwidth=LINK.bandwidth)
    )
    for _ in range(4):
        calibrator.observe(run.timeline)
    return calibrator.records[0]


def test_a_pipeline_built_from_a_searched_plan_keeps_the_plans_link() -> None:
    """A plan searched with a measured intra link carries it in ``costs``; the run's transfers are one size, so
    the fit keeps that bandwidth and finds the latency the simulated link had."""
    plan = sw.plan(PRIOR, 2, global_batch=8, intra=LINK, recompute=(None,), schedules=["1f1b"])[0]
    assert plan.costs is not None and plan.costs.bandwidth == LINK.bandwidth
    record = calibrated(RunCalibrator(fake_pipe(plan), cores=2, warmup=1))
    assert record["bandwidth_Bps"] == LINK.bandwidth and record["bandwidth_from"] == "the plan's link"
    assert record["latency_s"] == pytest.approx(LINK.latency, rel=1e-9)
    assert "one size" in record["link"] and "bandwidth 2.05e+03 B/s kept" in record["link"]


def test_a_probe_or_a_number_wins_over_the_plan() -> None:
    probe = Calibration(intra=Link(1e-4, 4096.0))
    plan = SimpleNamespace(costs=SimpleNamespace(bandwidth=1e9))
    assert link_prior(fake_pipe(plan), probe) == (4096.0, 4096.0, "the calibration's intra link")
    assert link_prior(fake_pipe(plan), 512.0) == (512.0, 512.0, "given")
    assert link_prior(fake_pipe(plan)) == (1e9, 1e9, "the plan's link")
    assert link_prior(fake_pipe(), Calibration())[:2] == (math.inf, math.inf)


def test_the_link_between_machines_keeps_the_inter_probe_and_the_one_inside_the_intra() -> None:
    """A ping-pong inside a machine reads loopback; kept for the link between machines it priced a 100 Mbit link
    at 4.2 GB/s (issue 49): each link keeps its own probe, the plan's two links likewise."""
    both = Calibration(intra=Link(1e-5, 4e9), inter=Link(1e-3, 1.2e7))
    assert link_prior(fake_pipe(), both) == (1.2e7, 4e9, "the calibration's inter and intra link")
    assert link_prior(fake_pipe(), Calibration(inter=Link(1e-3, 1.2e7)))[:2] == (1.2e7, 1.2e7)
    plan = SimpleNamespace(costs=SimpleNamespace(bandwidth=1.2e7, local_bandwidth=4e9, rank_nodes=(0, 0, 1, 1)))
    assert link_prior(fake_pipe(plan)) == (1.2e7, 4e9, "the plan's link")
    with pytest.raises(ValueError, match="bandwidth must be > 0"):
        link_prior(fake_pipe(), 0.0)


def test_without_a_plan_or_a_probe_the_bandwidth_is_infinite_and_said() -> None:
    """A plan searched without measured links (``Link()``: infinite) gives nothing to keep either."""
    with pytest.warns(UserWarning, match="links are not calibrated"):
        unmeasured = sw.plan(PRIOR, 2, global_batch=8, recompute=(None,), schedules=["1f1b"])[0]
    for pipe in (fake_pipe(), fake_pipe(unmeasured)):
        record = calibrated(RunCalibrator(pipe, cores=2, warmup=1))
        assert record["bandwidth_Bps"] == math.inf and record["bandwidth_from"] == "none"
        assert "no prior bandwidth: infinite" in record["link"]


def test_a_messages_cpu_comes_with_the_calibration_or_the_plan() -> None:
    """``link_cpu`` left out: the calibration's probe (``sw.calibrate(nodes=2)``), else what the plan was searched
    with (a plan across nodes keeps it in ``costs``), else 0; given, it wins."""
    probe = Calibration(inter=Link(1e-3, 1.2e7), link_cpu=0.4, nodes=2)
    found = sw.plan(PRIOR, 2, nodes=2, global_batch=8, calibration=probe, recompute=(None,), schedules=["1f1b"])[0]
    assert found.costs is not None and found.costs.link_cpu == 0.4
    assert RunCalibrator(fake_pipe(), cores=2, bandwidth=probe).link_cpu == 0.4
    assert RunCalibrator(fake_pipe(found), cores=2).link_cpu == 0.4
    assert RunCalibrator(fake_pipe(found), cores=2, link_cpu=0.1).link_cpu == 0.1
    assert RunCalibrator(fake_pipe(), cores=2).link_cpu == 0.0
