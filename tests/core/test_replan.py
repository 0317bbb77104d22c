"""The re-plan decision (issue 49 item 3): pure, every decision a plain record, a log that replays."""

from __future__ import annotations

import json
import math

import pytest
from test_stragglers import PLAN, PRIOR, run  # the synthetic timelines of the detector's tests

from stagewise import build_schedule
from stagewise.planning.recalibrate import Z85, calibrate_run
from stagewise.planning.replan import (
    CHANGE,
    COOLDOWN,
    NO_BETTER,
    NOT_WORTH,
    Decisions,
    Option,
    decide,
    line,
    moved_share,
    noise_margin,
    options_for,
    relayout_cost,
    relayout_seconds,
    replay,
    step_spread,
)
from stagewise.planning.stragglers import cut_for_speeds

A = Option("1f1b", (4, 4), 0.100)
B = Option("1f1b", (6, 2), 0.080)
C = Option("zb-h1", (4, 4), 0.090)


def _decide(**kw: object) -> dict:
    args: dict = {"steps_left": 100, "relayout_s": 1.0, "margin_s": 0.5, "cooldown": 5, "last_change": None}
    args.update(kw)
    return decide(10, A, [A, B, C], **args)


def test_gain_below_cost_keeps_the_plan() -> None:
    # (0.100 - 0.080) x 70 = 1.4 s saved <= 1.0 s + 0.5 s
    record = _decide(steps_left=70)
    assert (record["taken"], record["reason"]) == (False, NOT_WORTH)
    assert record["best"] == B.to_json() and record["gain_s"] == pytest.approx(1.4)


def test_gain_above_cost_changes_to_the_fastest() -> None:
    # (0.100 - 0.080) x 80 = 1.6 s > 1.5 s
    record = _decide(steps_left=80)
    assert (record["taken"], record["reason"]) == (True, CHANGE)
    assert record["best"] == B.to_json()
    assert "applied" in line(record) and "[6, 2]" in line(record)


def test_the_margin_and_the_cost_both_count() -> None:
    assert _decide(steps_left=80, margin_s=0.7)["taken"] is False
    assert _decide(steps_left=80, relayout_s=1.2)["taken"] is False
    assert _decide(steps_left=80, relayout_s=0.0, margin_s=0.0)["taken"] is True


def test_nothing_faster_is_no_change() -> None:
    record = decide(3, B, [A, B, C], steps_left=10**6, relayout_s=0, margin_s=0, cooldown=0, last_change=None)
    assert (record["taken"], record["reason"]) == (False, NO_BETTER)
    alone = decide(3, A, [A], steps_left=10, relayout_s=0, margin_s=0, cooldown=0, last_change=None)
    assert alone["best"] is None and alone["reason"] == NO_BETTER


def test_cooldown_blocks_a_flap() -> None:
    d = Decisions(margin_s=0.0, cooldown=4)
    assert d.consider(5, A, [A, B], steps_left=100, relayout_s=0.1)["taken"]
    # a noisy step now predicts A faster than B: within the cooldown B is kept
    back = Option("1f1b", (4, 4), 0.070)
    for step in (6, 7, 8):
        record = d.consider(step, B, [back, B], steps_left=100, relayout_s=0.1)
        assert (record["taken"], record["reason"]) == (False, COOLDOWN)
    assert d.consider(9, B, [back, B], steps_left=100, relayout_s=0.1)["taken"]  # cooldown over
    assert [r["step"] for r in d.log if r["taken"]] == [5, 9]


def test_a_log_replays_to_the_same_decisions() -> None:
    d = Decisions(margin_s=0.2, cooldown=3)
    now = A
    plans = [A, B, C, Option("zb-h1", (5, 3), 0.060)]
    for step in range(5, 20):
        # predictions that drift with the step, as a recalibrated model's would
        candidates = [
            Option(p.schedule, p.counts, p.step_s * (1 + 0.3 * ((step + i) % 3 - 1))) for i, p in enumerate(plans)
        ]
        current = next(c for c in candidates if c.same_plan(now))
        record = d.consider(step, current, candidates, steps_left=40 - step, relayout_s=0.5)
        if record["taken"]:
            now = Option.from_json(record["best"])
    taken = [r for r in d.log if r["taken"]]
    assert 2 <= len(taken) < len(d.log)  # the log holds changes and refusals alike
    log = [json.loads(json.dumps(r)) for r in d.log]  # through JSON lines
    assert replay(log) == log
    # a log whose decision was edited does not replay to itself
    log[0]["taken"] = not log[0]["taken"]
    assert replay(log) != log


def test_bad_inputs_are_named() -> None:
    with pytest.raises(ValueError, match="steps_left, relayout_s, margin_s and cooldown"):
        _decide(steps_left=-1)
    with pytest.raises(ValueError, match="bandwidth"):
        relayout_seconds(1e6, 0.0, 0.1)
    assert relayout_seconds(2e6, 1e6, 0.5) == pytest.approx(2.5)


def test_candidates_for_a_straggler_and_other_schedules() -> None:
    cal = calibrate_run([run([1.0, 1.0])] * 5, PLAN, PRIOR, [4, 4], cores=2)
    zb = build_schedule("zb-h1", 2, 4)
    current, candidates = options_for(cal, PRIOR, PLAN, [4, 4], [1.0, 0.25], [zb, PLAN])
    cut, now, after = cut_for_speeds(cal.profile(PRIOR), PLAN, [4, 4], [1.0, 0.25], cal)
    assert current == Option("1f1b", (4, 4), now)
    assert candidates[:2] == [current, Option("1f1b", tuple(cut), after)]
    assert cut[1] < 4 and after < now  # layers off the slow rank, predicted faster
    assert [c.schedule for c in candidates] == ["1f1b", "1f1b", "zb-h1"]  # the running one not twice
    assert candidates[2].counts[1] < 4 and candidates[2].step_s < now
    # at equal speeds the calibrated cut is the running one: nothing to gain
    _, same = options_for(cal, PRIOR, PLAN, [4, 4], [1.0, 1.0])
    record = decide(5, same[0], same, steps_left=10**6, relayout_s=0, margin_s=0, cooldown=0, last_change=None)
    assert record["reason"] == NO_BETTER


def test_the_step_to_step_spread_ignores_a_level_shift() -> None:
    """Hand-computed: differences 0.1, 0.1, 0.2, 0.1 (median 0.1) over sqrt 2, over the median step 1.0; a
    doubling halfway is one difference, which the median outvotes."""
    assert step_spread([1.0, 1.1, 1.0, 0.8, 0.9]) == pytest.approx(0.1 / 2**0.5 / 1.0)
    steady = [1.0, 1.1] * 4
    shifted = steady + [2 * s for s in steady]
    assert step_spread(steady) == pytest.approx(0.1 / 2**0.5 / 1.05)
    assert step_spread(shifted) < 2 * step_spread(steady)  # the shift is not taken for noise
    assert step_spread([1.0]) == 0.0 and step_spread([]) == 0.0


def test_the_margin_is_the_noise_over_the_steps_left() -> None:
    """Hand-computed: each step's own noise averages out over the steps left (their square root), an error of the
    estimates (the calibration's, the speeds') is an error of every step's saving (their number)."""
    # the steps' noise alone: 1.44 x 0.1 s x sqrt(100 x 0.05^2) = 0.072 s
    assert noise_margin(0.1, 100, spread=0.05) == pytest.approx(0.072)
    # the estimates' error alone: 1.44 x 0.1 s x 100 x hypot(0.03, 0.04) = 0.72 s
    assert noise_margin(0.1, 100, uncertainty=0.03, speed_error=0.04) == pytest.approx(0.72)
    # both: 1.44 x 0.1 x sqrt(5^2 + 100 x 0.05^2) = 1.44 x 0.1 x sqrt(25.25)
    both = noise_margin(0.1, 100, spread=0.05, uncertainty=0.03, speed_error=0.04)
    assert both == pytest.approx(0.144 * math.sqrt(25.25))
    with pytest.raises(ValueError, match="noise_margin: step_s, steps_left, spread"):
        noise_margin(0.1, 100, spread=-0.1)
    # B saves 0.02 s a step of A's 0.1 s (20 %): taken at a speed error of 0.1 (margin 14.4 % a step), kept at 0.2
    quiet, noisy = Decisions(cooldown=0), Decisions(cooldown=0)
    calm = quiet.consider(1, A, [A, B], steps_left=100, relayout_s=0.0, speed_error=0.1)
    loud = noisy.consider(1, A, [A, B], steps_left=100, relayout_s=0.0, speed_error=0.2)
    assert calm["taken"] and calm["margin_s"] == pytest.approx(1.44 * 0.1 * 0.1 * 100)
    assert (loud["taken"], loud["reason"], loud["speed_error"]) == (False, NOT_WORTH, 0.2)
    assert replay(quiet.log + noisy.log) == [calm, {**loud, "last_change": 1}]


def test_the_steps_noise_shrinks_against_the_gain_as_the_steps_left_grow() -> None:
    """A saving of 2 % a step at a step-to-step spread of 10 %: z 0.1 sqrt(n) < 0.02 n from n = (7.2)^2 = 51.84
    on; an error of the estimates of the same 10 % never lets it through, however many steps are left."""
    a, b = Option("1f1b", (4, 4), 1.0), Option("1f1b", (5, 3), 0.98)
    kept = Decisions(cooldown=0).consider(1, a, [a, b], steps_left=51, relayout_s=0.0, spread=0.1)
    taken = Decisions(cooldown=0).consider(1, a, [a, b], steps_left=52, relayout_s=0.0, spread=0.1)
    assert (kept["taken"], taken["taken"]) == (False, True)
    for n in (52, 10**3, 10**6):
        assert not Decisions(cooldown=0).consider(1, a, [a, b], steps_left=n, relayout_s=0.0, speed_error=0.1)["taken"]


def test_the_calibrations_own_uncertainty_widens_the_margin() -> None:
    """Two calibrating steps whose stage 0 computed 1 s and 3 s: its spread is sqrt 2 / 2 (sample standard
    deviation over the mean); with stage spreads 0.3 and 0.4 over 2 steps the uncertainty is 1.25 x sqrt(2 / 2)
    x their root mean square; a decision's margin counts it on every step left, with the speeds' error
    (0.3 and 0.4 -> 0.5), and the steps' spread over their square root."""
    from stagewise.ir import Action, Event, Kind, Timeline
    from stagewise.planning.recalibrate import RunCalibration, stage_spreads

    steps = [Timeline("x", 1, [Event(0, Action(0, Kind.F, 0), 0.0, t)], source="measured") for t in (1.0, 3.0)]
    assert stage_spreads(steps, 8.0, 1) == pytest.approx((math.sqrt(2) / 2,))
    cal = RunCalibration((1, 1), {}, 0.0, math.inf, 2.0, (1.0, 1.0), stage_spread=(0.3, 0.4))
    assert cal.uncertainty == pytest.approx(1.25 * math.sqrt(0.125))
    d = Decisions(cooldown=0, z=2.0)
    now, best = Option("1f1b", (4, 4), 1.0), Option("1f1b", (5, 3), 0.5)
    record = d.consider(
        3, now, [now, best], steps_left=10, relayout_s=0.0, spread=0.1, uncertainty=0.3, speed_error=0.4
    )
    assert record["margin_s"] == pytest.approx(2.0 * 1.0 * math.sqrt((10 * 0.5) ** 2 + 10 * 0.1**2))
    # speeds measured against this calibration: its error is theirs too, but for the layers moved (1 of 5: 0.2)
    absorbed = Decisions(cooldown=0, z=2.0).consider(
        3, now, [now, best], steps_left=10, relayout_s=0.0, spread=0.1, uncertainty=0.3, speed_error=0.4,
        speeds_measured=True,
    )  # fmt: skip
    assert absorbed["margin_s"] == pytest.approx(2.0 * math.sqrt((10 * math.hypot(0.3 * 0.2, 0.4)) ** 2 + 0.1))
    assert record["uncertainty"] == 0.3 and record["speed_error"] == 0.4
    assert not record["taken"] and record["gain_s"] == 5.0  # 5 s of gain against a 10.04 s margin
    with pytest.raises(ValueError, match="uncertainty and speed_error must be >= 0"):
        d.consider(4, now, [now, best], steps_left=10, relayout_s=0.0, uncertainty=-1.0)


def test_the_moved_share_is_the_largest_part_of_a_stage_new_to_it() -> None:
    """[4, 4] -> [6, 2]: stage 0 takes layers 4 and 5 (2 of its 6), stage 1 keeps 2 of its own; [2, 6]: stage 1
    takes 2 of 6; [4, 2, 2] -> [2, 2, 4]: stage 1 now holds layers 2-3, none of which it held (4-5); another
    schedule moves everything."""
    assert moved_share(A, Option("1f1b", (6, 2), 0.0)) == pytest.approx(2 / 6)
    assert moved_share(A, Option("1f1b", (2, 6), 0.0)) == pytest.approx(2 / 6)
    assert moved_share(A, A) == 0.0
    assert moved_share(Option("1f1b", (4, 2, 2), 0.0), Option("1f1b", (2, 2, 4), 0.0)) == 1.0
    assert moved_share(A, Option("zb-h1", (4, 4), 0.0)) == 1.0


def test_a_first_relayouts_one_off_costs_are_not_charged_to_the_next_move() -> None:
    """The last re-layout measured, unless it was the process's first (one-off costs in it): then at most the
    predicted figure; the predicted one before any."""
    assert relayout_cost([], 1.0) == 1.0
    assert relayout_cost([2.28], 1.0) == 1.0  # the first (a build's warm-up in it): no evidence of the next
    assert relayout_cost([0.5], 1.0) == 0.5  # ... but never more than it cost
    assert relayout_cost([2.28, 0.15], 1.0) == 0.15  # measured again: the last
    assert relayout_cost([2.28, 0.15, 0.09], 1.0) == 0.09
    with pytest.raises(ValueError, match="relayout_cost: seconds must be >= 0"):
        relayout_cost([-1.0], 1.0)


#: the quiet run's decision after the throttle lifted (docs/benchmarks/stragglers.md, 2026-12-02 09:21, step 41):
#: [7, 3] predicted 119.04 ms, [5, 5] 94.70 ms, 211 steps left; the steps' spread, the calibration's uncertainty
#: and the speeds' error as recorded; its first and only re-layout so far had taken 2.277 s
NOW, BACK = Option("1f1b", (7, 3), 0.1190420961319946), Option("1f1b", (5, 5), 0.09470135587021053)
LIFTED = {"steps_left": 211, "spread": 0.0341068, "uncertainty": 0.1863003, "speed_error": 0.0718442}


def test_moved_back_when_the_throttle_lifts_charged_what_a_move_costs_now() -> None:
    """Hand-computed: the gain (119.04 - 94.70 ms) x 211 = 5.136 s; the margin 1.44 x 119.04 ms x
    sqrt((211 e)^2 + 211 x 0.0341^2), e = hypot(0.1863 x 2/5, 0.0718) (2 of [5, 5]'s second stage's 5 layers
    are moved in) = 3.745 s. Charged the process's first re-layout (2.277 s: 6.02 s) it was refused, as the quiet
    run refused it; charged what the next one costs (:func:`relayout_cost`: at most the 1.0 s predicted) the
    4.74 s are cleared and the layers move back."""
    e = math.hypot(0.1863003 * 2 / 5, 0.0718442)
    margin = Z85 * NOW.step_s * math.sqrt((211 * e) ** 2 + 211 * 0.0341068**2)
    assert margin == pytest.approx(3.745, abs=0.001)
    first = Decisions(cooldown=4).consider(41, NOW, [NOW, BACK], relayout_s=2.2768975, speeds_measured=True, **LIFTED)
    assert first["gain_s"] == pytest.approx(5.136, abs=0.001) and first["margin_s"] == pytest.approx(margin)
    assert (first["taken"], first["reason"]) == (False, NOT_WORTH)
    cost = relayout_cost([2.2768975], 1.0)
    back = Decisions(cooldown=4).consider(41, NOW, [NOW, BACK], relayout_s=cost, speeds_measured=True, **LIFTED)
    assert (back["taken"], back["reason"], back["best"]["counts"]) == (True, CHANGE, [5, 5])
    assert back["gain_s"] - back["margin_s"] - back["relayout_s"] == pytest.approx(5.136 - 3.745 - 1.0, abs=0.002)
