"""The link fitted from the run's waited transfers (issue 49 item 2): latency and bandwidth recovered where the
message sizes identify them, the prior's bandwidth kept (and said) where they do not."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from helpers.profiles import fake_profile
from stagewise import build_schedule, simulate
from stagewise.ir import Action, Event, Kind, Timeline
from stagewise.planning.link_fit import fit_link, reduce_transfers
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


STEP_, SYNC_ = Kind.STEP, Kind.SYNC


def replicas(rows: list[tuple[int, int, Kind, float, float]]) -> list[Timeline]:
    """The timelines of one step's replicas from ``(replica, stage, kind, start, end)`` (stage s on rank s)."""
    n = 1 + max(r for r, *_ in rows)
    return [
        Timeline("1f1b", 2, [Event(s, Action(s, k, None), t0, t1) for q, s, k, t0, t1 in rows if q == r])
        for r in range(n)
    ]


def test_the_all_reduce_identifies_the_bandwidth_once_its_wait_is_taken_out() -> None:
    """Two replicas over 0.25 s + bytes / 256 B/s. The transfers carry one size (64 B, 0.5 s each); the
    stages' gradient all-reduces (1024 B and 512 B: a ring of 2 messages of 512 B / 256 B, 2 x 2.25 s and
    2 x 1.25 s) identify the bandwidth. Step 1, stage 0: replica 1's SYNC starts last (2 s), so the
    reduction ends at 6.5 s; replica 0 sat in its STEP from 1.5 s and left it at 7 s (the optimizer: 0.5 s,
    the least any STEP 0 took). Stage 1: ready at 0.5 s, done at 3 s (replica 0 left its STEP at 3.5 s);
    replica 1 came to its STEP after that (5 s, 0.5 s long: not a wait). Step 2 waited for nothing."""
    one = replicas([
        (0, 0, SYNC_, 1.0, 1.01), (1, 0, SYNC_, 2.0, 2.01), (0, 0, STEP_, 1.5, 7.0), (1, 0, STEP_, 3.0, 7.0),
        (0, 1, SYNC_, 0.0, 0.01), (1, 1, SYNC_, 0.5, 0.51), (0, 1, STEP_, 0.2, 3.5), (1, 1, STEP_, 5.0, 5.5),
    ])  # fmt: skip
    two = replicas([
        (0, 0, SYNC_, 0.0, 0.01), (1, 0, SYNC_, 0.0, 0.01), (0, 0, STEP_, 5.0, 5.5), (1, 0, STEP_, 6.0, 6.5),
        (0, 1, SYNC_, 0.0, 0.01), (1, 1, SYNC_, 0.0, 0.01), (0, 1, STEP_, 3.0, 3.5), (1, 1, STEP_, 2.5, 3.0),
    ])  # fmt: skip
    pairs = reduce_transfers([one, two], [1024.0, 512.0])
    assert pairs == [(512.0, 2.25), (256.0, 1.25)]
    transfers = [three_stages(0.5, 0.5, 0.5, 0.5)]
    fit = fit_link(transfers, GPIPE3, [64.0, 64.0, 0.0], reductions=pairs)
    assert (fit.latency, fit.bandwidth, fit.identified, fit.sizes) == (0.25, 256.0, True, 3)
    assert "6 waited transfers (2 of them all-reduce messages) of 3 sizes" in fit.note
    alone = fit_link(transfers, GPIPE3, [64.0, 64.0, 0.0])
    assert (alone.bandwidth, alone.identified) == (math.inf, False)


def test_an_all_reduce_without_replicas_or_a_wait_says_nothing() -> None:
    """One replica, a stage without parameters, or every STEP as long as the optimizer: no pair."""
    rows = [(0, 0, SYNC_, 0.0, 0.1), (1, 0, SYNC_, 1.0, 1.1), (0, 0, STEP_, 2.0, 2.5), (1, 0, STEP_, 2.0, 2.5)]
    assert reduce_transfers([replicas(rows)[:1]], [1024.0]) == []
    assert reduce_transfers([replicas(rows)], [0.0]) == []
    assert reduce_transfers([replicas(rows)], [1024.0]) == []


def test_a_run_with_replicas_calibrates_its_own_step_with_the_ring() -> None:
    """A 1F1B run with 2 replicas whose SYNC costs the ring all-reduce over the true link: calibrated with
    that link's pairs (40 and 60 B of parameters: messages of 20 and 30 B; the transfers carry 1 B), the link is
    identified and its own prediction includes the ring, so the bias is 1."""
    from stagewise.planning.comm import Link, ring_all_reduce

    prior = fake_profile([1.0, 2.0, 1.0, 1.0, 2.0, 1.0], params=[10.0, 20.0, 10.0, 10.0, 20.0, 30.0])
    link = Link(0.01, 1e3)
    plan = build_schedule("1f1b", 2, 4)
    costs = prior.cost_model([0, 3, 6], latency=0.01, bandwidth=1e3)
    sync = tuple(ring_all_reduce(b, 2, link) for b in costs.parameter_bytes)
    run = simulate(plan, replace(costs, sync_time=sync))
    pairs = [(b / 2, link.time(b / 2)) for b in costs.parameter_bytes if b > 0]
    cal = calibrate_run([run.timeline] * 3, plan, prior, [3, 3], cores=8, dp=2, reductions=pairs)
    assert cal.latency == pytest.approx(0.01, rel=1e-9) and cal.bandwidth == pytest.approx(1e3, rel=1e-9)
    assert "identified" not in cal.link and "2 of them all-reduce messages" in cal.link
    assert cal.bias == pytest.approx(1.0, rel=1e-9)
    flat = calibrate_run([run.timeline] * 3, plan, prior, [3, 3], cores=8, reductions=pairs)
    assert flat.bias > 1.0  # without dp the ring is not in the model, and the bias carries it
