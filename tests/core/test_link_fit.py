"""The link fitted from the run's waited transfers (issue 49 item 2): latency and bandwidth recovered where the
message sizes identify them, the prior's bandwidth kept (and said) where they do not."""

from __future__ import annotations

import math

import pytest

from helpers.profiles import fake_profile
from stagewise import build_schedule, simulate
from stagewise.ir import Action, Event, Kind, Timeline
from stagewise.planning.link_fit import fit_link
from stagewise.planning.recalibrate import calibrate_run

F, B = Kind.F, Kind.B
GPIPE3 = build_schedule("gpipe", 3, 1)


def three_stages(d01: float, d12: float, d21: float, d10: float) -> Timeline:
    """GPipe on 3 ranks, 1 micro-batch: F 1 s, B 2 s; each transfer waited for its given delay (seconds).

    rank 0: F0 [0, 1]                                              B0 [t5, t5 + 2]
    rank 1:      F1 [1 + d01, 2 + d01]                B1 [t4, t4 + 2]
    rank 2:                F2 [t2, t2 + 1] B2 [.., ..]
    """
    f1 = 1 + d01
    f2 = f1 + 1 + d12
    b2 = f2 + 1
    b1 = b2 + 2 + d21
    b0 = b1 + 2 + d10
    rows = [(0, F, 0.0, 1.0), (1, F, f1, f1 + 1), (2, F, f2, f2 + 1), (2, B, b2, b2 + 2), (1, B, b1, b1 + 2)]
    rows.append((0, B, b0, b0 + 2))
    return Timeline("gpipe", 3, [Event(s, Action(s, k, 0), t0, t1) for s, k, t0, t1 in rows], source="measured")


def test_two_sizes_recover_the_latency_and_the_bandwidth() -> None:
    """Stage 0 sends 100 B, stage 1 300 B over 0.25 s + bytes / 400 B/s: 0.5 s and 1 s, forward and back."""
    fit = fit_link([three_stages(0.5, 1.0, 1.0, 0.5)], GPIPE3, [100.0, 300.0, 0.0], prior_bandwidth=1e6)
    assert (fit.latency, fit.bandwidth, fit.identified) == (0.25, 400.0, True)
    assert (fit.transfers, fit.sizes) == (4, 2) and "fitted through 4 waited transfers of 2 sizes" in fit.note


def test_one_size_keeps_the_prior_bandwidth_and_says_so() -> None:
    """Every boundary sends 64 B, each waited 0.5 s: any bandwidth fits. The prior's 256 B/s is kept and the
    latency is what is left of the delay: 0.5 - 64 / 256. (The old fit: infinite bandwidth, latency 0.5.)"""
    fit = fit_link([three_stages(0.5, 0.5, 0.5, 0.5)], GPIPE3, [64.0, 64.0, 0.0], prior_bandwidth=256.0)
    assert (fit.latency, fit.bandwidth, fit.identified) == (0.25, 256.0, False)
    assert "one size (64 B): bandwidth not identified, the prior's bandwidth 256 B/s kept" in fit.note
    free = fit_link([three_stages(0.5, 0.5, 0.5, 0.5)], GPIPE3, [64.0, 64.0, 0.0])
    assert (free.latency, free.bandwidth) == (0.5, math.inf) and "no prior bandwidth" in free.note


def test_a_slope_inside_its_noise_is_not_a_bandwidth() -> None:
    """100 and 104 B; one 104 B transfer waited 0.75 s, the others 0.5 s: least squares gives a slope of
    1/32 s per byte with a standard error of 1/32 (t = 1 < 2), so the prior's bandwidth is kept."""
    fit = fit_link([three_stages(0.5, 0.75, 0.5, 0.5)], GPIPE3, [100.0, 104.0, 0.0], prior_bandwidth=400.0)
    assert (fit.bandwidth, fit.identified, fit.sizes) == (400.0, False, 2)
    assert fit.latency == pytest.approx(0.25, abs=1e-12)  # delay - bytes / 400: median of 0.25, 0.49, 0.24, 0.25
    assert "sizes 100-104 B (slope in the noise)" in fit.note


def test_the_run_calibrated_with_a_prior_bandwidth_prices_other_message_sizes() -> None:
    """The run (1F1B, one message size) over 0.01 s + bytes / 1000 B/s; calibrated with that bandwidth as the
    prior, a plan sending other sizes (another cut, 3 ranks) is predicted as the truth simulates it."""
    prior = fake_profile([1.0, 2.0, 1.0, 1.0, 2.0, 1.0])
    link = {"latency": 0.01, "bandwidth": 1e3}
    plan = build_schedule("1f1b", 2, 4)
    run = simulate(plan, prior.cost_model([0, 3, 6], **link))
    cal = calibrate_run([run.timeline] * 3, plan, prior, [3, 3], cores=8, prior_bandwidth=1e3)
    assert cal.latency == pytest.approx(0.01, rel=1e-9) and cal.bandwidth == 1e3
    assert "not identified" in cal.link
    q = build_schedule("zb-h1", 3, 6)
    sizes = [10.0, 50.0, 0.0]
    got = cal.predict(q, cal.profile(prior).cost_model([0, 2, 4, 6], output_bytes=sizes), processes_per_node=3)
    want = simulate(q, prior.cost_model([0, 2, 4, 6], output_bytes=sizes, **link)).makespan
    assert got.step == pytest.approx(want, rel=1e-9)
