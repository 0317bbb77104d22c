"""The held-out benchmark's measurement noise (benchmarks/calibration/noise.py, report.py): a plan built several
times, its level, the between-build spread, the noise floor a perfect model scores, and the figures judged
against them; and P calibrated from several builds pooled. Hand-computed figures, no processes, no timing."""

from __future__ import annotations

import math
import random
import statistics

import pytest
from benchmarks.calibration.noise import between_builds, level, noise_floor, oracle_coverage, within_builds
from benchmarks.calibration.report import apart_by_builds, kendall, noise, one_build, summary

from helpers.profiles import fake_profile
from stagewise import build_schedule, simulate
from stagewise.planning.recalibrate import calibrate_run


def test_a_plans_level_is_the_geometric_mean_of_its_builds_medians() -> None:
    assert level([[1.0, 2.0, 3.0], [4.0]]) == pytest.approx(math.sqrt(8.0), rel=1e-12)  # medians 2 and 4
    assert level([[5.0, 1.0, 3.0]]) == 3.0  # one build: its median
    with pytest.raises(ValueError, match="builds need steps > 0"):
        level([[]])


def test_the_between_build_spread_is_pooled_within_each_plan() -> None:
    """Plan a: build medians e^0, e^0.2 (logs 0, 0.2: squares about their mean 0.02, 1 df); plan b: e^1, e^1.1,
    e^0.9 (0.02, 2 df); a plan of one build adds nothing: sd sqrt(0.04 / 3), 3 df."""
    e = math.exp
    plans = [[[e(0.0)], [e(0.1), e(0.2), e(0.3)]], [[e(1.0)], [e(1.1)], [e(0.9)]], [[7.0, 8.0]]]
    sd, df = between_builds(plans)
    assert df == 3 and sd == pytest.approx(math.sqrt(0.04 / 3), rel=1e-9)
    sd_w, df_w = within_builds(plans)  # steps within a build: (0.1, 0.2, 0.3) and (7, 8)
    squares = 0.02 + (math.log(7) - math.log(56) / 2) ** 2 + (math.log(8) - math.log(56) / 2) ** 2
    assert df_w == 3 and sd_w == pytest.approx(math.sqrt(squares / 3), rel=1e-9)
    assert between_builds([[[1.0]], [[2.0]]]) == (0.0, 0)


def test_the_noise_floor_is_what_a_perfect_model_scores() -> None:
    """By hand: sqrt(2 / pi) x 0.1 x sqrt(1/3 + 1/3). And by simulation (seeded): 4000 plans whose true level a
    perfect model predicts, each measured as the geometric mean of 3 builds drawn at a between-build sd of 0.1,
    the model calibrated on 3 builds of P (its level error on every prediction of a job): the mean absolute log
    error over 200 jobs matches the floor within 3 %. Leaving P's term out (a mutant) gives 0.046, not 0.065."""
    assert noise_floor(0.1, 3, 3) == pytest.approx(math.sqrt(2 / math.pi) * 0.1 * math.sqrt(2 / 3), rel=1e-12)
    rng, errors = random.Random(49), []
    for _ in range(200):
        p_level = statistics.mean(rng.gauss(0, 0.1) for _ in range(3))  # P's measured level (log), truth 0
        for _ in range(20):
            q_level = statistics.mean(rng.gauss(0, 0.1) for _ in range(3))
            errors.append(abs(p_level - q_level))  # the perfect model's prediction carries P's level error
    assert statistics.mean(errors) == pytest.approx(noise_floor(0.1, 3, 3), rel=0.03)
    with pytest.raises(ValueError, match="builds must be >= 1"):
        noise_floor(0.1, 0, 3)


def test_the_oracles_coverage_is_the_share_within_the_width_of_each_plans_own_level() -> None:
    """Builds [1.0, 1.2] and [1.0]: level sqrt(1.1 x 1.0) = 1.0488; at twice a spread of 0.05 (0.1 either way) the
    steps 1.0 and 1.0 are inside, 1.2 is not: 2 of 3."""
    assert oracle_coverage([[[1.0, 1.2], [1.0]]], [0.05]) == pytest.approx(2 / 3)
    assert oracle_coverage([[[1.0, 1.2], [1.0]]], [0.1]) == 1.0


def row(name: str, builds: list[list[float]], predicted: float, m: int = 4) -> dict:
    plan = {"schedule": name, "microbatches": m, "pp": 2, "dp": 1, "partition": "time"}
    steps = [s for b in builds for s in b]
    return {"plan": plan, "builds": builds, "steps": steps, "predicted": predicted, "low": predicted * 0.9,
            "high": predicted * 1.1, "first": {"predicted": predicted * 2, "low": 0.0, "high": 9.0}}  # fmt: skip


def test_the_figures_judge_each_plans_level_against_its_builds() -> None:
    """Three plans of 2 builds. a: medians 1.0, 1.21 (level 1.1); b: 2.0, 2.0 (level 2); c: 2.2, 2.2 (2.2). The
    between-build sd pools a's logs (0, log 1.21: sd log(1.21) / sqrt 2) with b's and c's zeros: 3 df. a and b
    differ by log(2 / 1.1) = 0.598, far beyond twice their standard error; b and c by log 1.1 = 0.095, which the
    builds cannot separate (2 x 0.0673 x sqrt(1/2 + 1/2) = 0.135), but the steps' spreads (0) can."""
    rows = [row("a", [[1.0, 1.0], [1.21, 1.21]], 1.1), row("b", [[2.0, 2.0], [2.0, 2.0]], 1.9),
            row("c", [[2.2, 2.2], [2.2, 2.2]], 1.8)]  # fmt: skip
    result = {"workload": "w", "world": 2, "plans": rows, "p_builds": [[1.0], [1.0]]}
    got = noise(result)
    sd = math.sqrt((math.log(1.21) ** 2 / 2) / 4)  # a's squares over 4 df (b, c and P's two builds add 0 and 1 each)
    assert got["between df"] == 4 and got["between sd"] == pytest.approx(sd, rel=1e-9)
    assert got["floor mae"] == pytest.approx(noise_floor(sd, 2, 2), rel=1e-12)
    half = math.log(1.21) / 2  # a's rounds sit at -half and +half about its level; b's and c's at 0
    assert got["round drift"] == pytest.approx([-half / 3, half / 3], rel=1e-9)
    s = summary(result)
    errors = [1.1 / 1.1 - 1, 1.9 / 2.0 - 1, 1.8 / 2.2 - 1]
    assert s["mean abs error"] == pytest.approx(statistics.mean(abs(e) for e in errors), rel=1e-9)
    tau_b, pairs_b = kendall(rows, apart_by_builds(sd))
    assert pairs_b == 2 and tau_b == 1.0  # (a, b) and (a, c); (b, c) not separable by the builds
    tau, pairs = kendall(rows)  # the issue's judge: steps' spreads (a's is 0.105 over its 4 steps)
    assert pairs == 3 and tau == pytest.approx(1 / 3)  # b over c is measured, c under b predicted: one disagrees


def test_one_build_is_round_zero_alone_predicted_from_the_first_p() -> None:
    result = {"workload": "w", "world": 2, "plans": [row("a", [[1.0, 1.0], [3.0]], 1.1)], "p_builds": [[1.0], [2.0]]}
    single = one_build(result)
    assert single["plans"][0]["steps"] == [1.0, 1.0] and single["plans"][0]["predicted"] == 2.2
    assert single["p_builds"] == [[1.0]]


def test_p_built_twice_calibrates_on_both_builds_pooled() -> None:
    """1F1B, 2 ranks, 4 micro-batches of F 1 s and B 2 s: makespan 15 s. Two builds of P: timed steps 15, 16.5
    and 18 (the first) and 21 (the second): the bias is their median over 15 s, 17.25 / 15 (the first build alone
    gives 16.5 / 15, the second 21 / 15)."""
    prior = fake_profile([3.0, 3.0])
    plan = build_schedule("1f1b", 2, 4)
    run = simulate(plan, prior.cost_model([0, 1, 2])).timeline
    cal = calibrate_run([run] * 4, plan, prior, [1, 1], cores=8, steps=[15.0, 16.5, 18.0, 21.0])
    assert cal.bias == pytest.approx(17.25 / 15.0, rel=1e-9)  # the median of four: (16.5 + 18) / 2
    one = calibrate_run([run] * 3, plan, prior, [1, 1], cores=8, steps=[15.0, 16.5, 18.0])
    assert one.bias == pytest.approx(1.1, rel=1e-9)
