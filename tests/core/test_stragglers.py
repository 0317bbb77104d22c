"""A slow rank told apart from a costly layer, on synthetic timelines (issue 49 item 3): one cost model (the
calibrated layers) and a speed per rank; named within a window of steps; the cut for the speeds measured."""

from __future__ import annotations

from dataclasses import replace

import pytest

from helpers.profiles import fake_profile
from stagewise import build_schedule, simulate
from stagewise.planning.recalibrate import calibrate_run
from stagewise.planning.stragglers import SLOW, WINDOW, Detector, cut_for_speeds, rank_speeds

PLAN = build_schedule("1f1b", 2, 4)
PRIOR = fake_profile([1.0] * 8)
BOUNDS = [0, 4, 8]


def run(speeds: list[float], profile=PRIOR, bounds=BOUNDS):
    """The simulator's timeline of PLAN with stage s's compute divided by its rank's speed."""
    costs = profile.cost_model(bounds)

    def slowed(values: tuple[float, ...]) -> tuple[float, ...]:
        return tuple(x / speeds[PLAN.placement[s]] for s, x in enumerate(values))

    kinds = ("forward", "backward_input", "backward_weight", "backward_full")
    costs = replace(costs, **{k: slowed(getattr(costs, k)) for k in kinds})
    return simulate(PLAN, costs).timeline


def calibrated():
    return calibrate_run([run([1.0, 1.0])] * WINDOW, PLAN, PRIOR, [4, 4], cores=2)


def test_a_slow_rank_has_its_speed_and_a_costly_layer_slows_no_rank() -> None:
    cal = calibrated()
    assert rank_speeds(run([1.0, 0.5]), cal, 2) == pytest.approx([1.0, 0.5])
    assert rank_speeds(run([1.0, 0.25]), cal, 2) == pytest.approx([1.0, 0.25])
    assert rank_speeds(run([1.0, 1.0]), cal, 2) == pytest.approx([1.0, 1.0])


def test_named_once_within_the_window_then_cleared() -> None:
    cal, detector = calibrated(), Detector(2)
    steps = [[1.0, 1.0]] * 2 + [[1.0, 0.5]] * 3 + [[1.0, 0.25]] * 3 + [[1.0, 1.0]] * 3
    said = [detector.observe(rank_speeds(run(s), cal, 2)) for s in steps]
    named = [k for k, (slow, _) in enumerate(said) if slow]
    assert named == [4] and said[4][0] == [1]  # the third slow step: the window's median is slow
    assert named[0] - 2 < 5  # within 5 steps of the slowdown (issue 49)
    cleared = [k for k, (_, back) in enumerate(said) if back]
    assert cleared == [10] and said[10][1] == [1]
    assert detector.speeds()[0] == pytest.approx(1.0)


def test_one_preempted_step_names_nobody_nor_does_a_node_wide_slowdown() -> None:
    detector = Detector(2)
    steps = [[1.0, 1.0], [1.0, 0.3], [1.0, 1.0], [1.0, 0.3], [1.0, 1.0], [0.5, 0.5], [0.4, 0.4], [0.5, 0.45]]
    for s in steps:
        assert detector.observe(s) == ([], [])
    assert SLOW < 1


def test_the_cut_for_the_measured_speeds_is_the_best_static_cut_for_them() -> None:
    """The oracle: every static cut simulated under the speeds; the chosen one is its best, and the predicted
    steps now and after are the oracle's figures for the running cut and the best."""
    cal = calibrated()
    layers = cal.profile(PRIOR)
    counts, now, after = cut_for_speeds(layers, PLAN, [4, 4], [1.0, 0.5], cal)
    oracle = {c: run([1.0, 0.5], bounds=[0, c, 8]).makespan for c in range(1, 8)}
    assert oracle[counts[0]] == min(oracle.values()) < oracle[4], (counts, oracle)
    assert (now, after) == (pytest.approx(oracle[4]), pytest.approx(min(oracle.values())))
    assert cut_for_speeds(layers, PLAN, [4, 4], [1.0, 1.0], cal)[0] == [4, 4]  # even speeds: the even cut
