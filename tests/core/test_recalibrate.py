"""Recalibration from the run's timeline (issue 49 item 2): the arithmetic against a hand-computed timeline,
the link fitted through waited transfers, and a held-out prediction that is exact when the model is."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.profiles import fake_profile
from stagewise import build_schedule, simulate
from stagewise.ir import Action, Event, Kind, Timeline
from stagewise.planning.recalibrate import calibrate_run, deshared, fit_link, shared_seconds, stage_medians

F, B = Kind.F, Kind.B


def hand_timeline() -> Timeline:
    """1F1B on 2 ranks, 2 micro-batches; F takes 1 s, B 2 s, a transfer 0.5 s (times binary-exact).

    rank 0: F0 [0, 1]   F1 [1, 2]                       B0 [5, 7]        B1 [8, 10]
    rank 1:        F0 [1.5, 2.5]  B0 [2.5, 4.5]  F1 [4.5, 5.5]  B1 [5.5, 7.5]
    """
    rows = [
        (0, 0, F, 0, 0.0, 1.0),
        (0, 0, F, 1, 1.0, 2.0),
        (1, 1, F, 0, 1.5, 2.5),
        (1, 1, B, 0, 2.5, 4.5),
        (1, 1, F, 1, 4.5, 5.5),
        (0, 0, B, 0, 5.0, 7.0),
        (1, 1, B, 1, 5.5, 7.5),
        (0, 0, B, 1, 8.0, 10.0),
    ]
    events = [Event(r, Action(s, k, m), t0, t1) for r, s, k, m, t0, t1 in rows]
    return Timeline("1f1b", 2, events, source="measured")


def test_a_core_each_the_events_are_their_own_cost() -> None:
    medians = stage_medians([hand_timeline()], cores=2)
    assert medians == {F: {0: 1.0, 1: 1.0}, B: {0: 2.0, 1: 2.0}}


def test_sharing_one_core_charges_each_event_the_rate_it_ran_at() -> None:
    """On 1 core, while both ranks compute each runs at half speed: rank 0's F1 overlaps rank 1's F0 for 0.5 s
    (0.5 + 0.25), rank 0's B0 overlaps rank 1 throughout (2 x 0.5), rank 1's B1 for 1.5 s of 2 (0.75 + 0.5)."""
    own = {(e.rank, e.action.kind, e.action.microbatch): x for e, x in deshared(hand_timeline(), cores=1)}
    assert own[(0, F, 0)] == 1.0 and own[(0, F, 1)] == 0.75 and own[(1, F, 0)] == 0.75
    assert own[(1, B, 0)] == 2.0 and own[(1, F, 1)] == 0.75 and own[(0, B, 0)] == 1.0
    assert own[(1, B, 1)] == 1.25 and own[(0, B, 1)] == 2.0
    assert stage_medians([hand_timeline()], cores=1) == {F: {0: 0.875, 1: 0.75}, B: {0: 1.5, 1: 1.625}}


def _shared_by_slices(spans: list[tuple[float, float]], cores: float) -> list[float]:
    """The definition, slice by slice: n(t) counted afresh between every two consecutive ends."""
    edges = sorted({t for span in spans for t in span})
    rate = []
    for t0, t1 in zip(edges, edges[1:]):
        n = sum(1 for a, b in spans if b > a and a < t1 and b > t0)
        rate.append((t0, t1, min(1.0, cores / n) if n else 1.0))
    return [sum((min(t1, b) - max(t0, a)) * r for t0, t1, r in rate if t0 < b and t1 > a) for a, b in spans]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 40), st.integers(0, 12)), min_size=1, max_size=30),
    st.sampled_from([0.5, 1.0, 2.0, 3.0]),
)
def test_the_sweep_gives_what_the_slices_give(starts: list[tuple[int, int]], cores: float) -> None:
    """:func:`shared_seconds` (a sweep, O(n log n)) against its definition on random spans, shared ends, empty
    spans and all: the same seconds to rounding."""
    spans = [(a / 8, (a + d) / 8) for a, d in starts]
    assert shared_seconds(spans, cores) == pytest.approx(_shared_by_slices(spans, cores), abs=1e-12)


def test_the_link_is_the_delay_of_the_transfers_a_rank_waited_for() -> None:
    """Rank 1's F0 waited 0.5 s for rank 0's F0, rank 0's B0 and B1 0.5 s for rank 1's; rank 1's F1 did not
    wait (its input came while B0 ran): one message size, so the median delay is the latency."""
    fit = fit_link([hand_timeline()], build_schedule("1f1b", 2, 2), [64.0, 64.0])
    assert (fit.latency, fit.bandwidth, fit.transfers) == (0.5, float("inf"), 3)


def test_two_message_sizes_give_latency_and_bandwidth() -> None:
    """3 ranks, messages of 100 and 300 bytes over a link of 0.1 s + bytes / 1000: the simulator's timeline."""
    schedule = build_schedule("gpipe", 3, 1)
    profile = fake_profile([3.0, 3.0, 3.0])
    layers = list(profile.layers)
    layers[0], layers[1] = replace(layers[0], output_bytes=100.0), replace(layers[1], output_bytes=300.0)
    profile = replace(profile, layers=tuple(layers))
    costs = profile.cost_model([0, 1, 2, 3], latency=0.1, bandwidth=1000.0)
    fit = fit_link([simulate(schedule, costs).timeline], schedule, costs.output_bytes)
    latency, bandwidth = fit.latency, fit.bandwidth
    assert fit.identified and latency == pytest.approx(0.1, rel=1e-9) and bandwidth == pytest.approx(1000.0, rel=1e-9)


def test_held_out_plans_are_predicted_exactly_when_the_profile_is_off_by_a_factor_per_stage() -> None:
    """The true layers run 0.5x and 1.5x what the prior profile says on the calibrating plan's two stages; the
    run (1F1B, cut 3 + 3) is the simulator's under the truth. Calibrated on it, every other plan (zb-v cut
    otherwise, more micro-batches, 3 ranks) is predicted as the truth simulates it, to rounding."""
    prior = fake_profile([1.0, 2.0, 1.0, 1.0, 2.0, 1.0])
    truth = fake_profile([0.5, 1.0, 0.5, 1.5, 3.0, 1.5])
    link = {"latency": 0.01, "bandwidth": 1e3}
    plan = build_schedule("1f1b", 2, 4)
    run = simulate(plan, truth.cost_model([0, 3, 6], **link))
    cal = calibrate_run([run.timeline] * 3, plan, prior, [3, 3], cores=8)
    assert cal.bias == pytest.approx(1.0, rel=1e-9) and cal.spread == 0.0
    assert (cal.latency, cal.bandwidth) == (pytest.approx(0.011), float("inf"))  # 10 bytes: one size
    calibrated = cal.profile(prior)
    for name, v, m, ranks, bounds in [
        ("zb-v", 2, 8, 2, [0, 2, 3, 4, 6]),
        ("1f1b", None, 8, 2, [0, 2, 6]),
        ("zb-h1", None, 6, 3, [0, 2, 4, 6]),
    ]:
        q = build_schedule(name, ranks, m, v)
        got = cal.predict(q, calibrated.cost_model(bounds), processes_per_node=ranks)
        want = simulate(q, truth.cost_model(bounds, latency=0.011)).makespan
        assert got.step == pytest.approx(want, rel=1e-9), name
        assert got.low < got.step < got.high


def test_the_bias_carries_what_the_model_misses_of_the_calibrating_run() -> None:
    """Measured steps 10 % longer than the model's own prediction of the plan: every prediction is 1.1x."""
    prior = fake_profile([1.0] * 4)
    plan = build_schedule("1f1b", 2, 4)
    timeline = simulate(plan, prior.cost_model([0, 2, 4])).timeline
    stretched = Timeline(timeline.name, 2, [*timeline.events, Event(0, Action(0, Kind.STEP), 0.0, 0.0)])
    last = max(e.end for e in timeline.events)
    stretched.events.append(Event(1, Action(1, Kind.STEP), last, last * 1.1))
    cal = calibrate_run([stretched], plan, prior, [2, 2], cores=8)
    assert cal.bias == pytest.approx(1.1, rel=1e-9)
    with pytest.raises(ValueError, match="must cut the profile's 4 layers into 2 stages"):
        calibrate_run([stretched], plan, prior, [1, 2], cores=8)


def test_held_out_costs_scale_with_the_micro_batch_and_sync_over_the_calibrated_link() -> None:
    from stagewise.planning.recalibrate import RunCalibration, held_out_costs

    prior = fake_profile([3.0, 3.0], params=[100.0, 300.0])
    cal = RunCalibration(
        counts=(1, 1), measured={F: {0: 2.0, 1: 2.0}}, latency=0.5, bandwidth=100.0, cores=2, steps=(1.0,)
    )
    costs = held_out_costs(cal, prior, [1, 1], batch_ratio=0.5, dp=2)
    assert costs.forward == (1.0, 1.0)  # measured 2 s (the prior said 1), at half the micro-batch
    assert costs.sync_time == (2 * (0.5 + 100 / 200), 2 * (0.5 + 300 / 200))  # 2 (n - 1) (latency + b / (n bw))
    assert held_out_costs(cal, prior, [2]).sync_time == (0.0,)
    probed = replace(cal, reduce=(0.25, 50.0))  # the replicas' all-reduce probed on its own link
    assert held_out_costs(probed, prior, [1, 1], dp=2).sync_time == (2 * (0.25 + 100 / 100), 2 * (0.25 + 300 / 100))
    assert held_out_costs(probed, prior, [1, 1], dp=2).sync_cpu == 0.0  # probed with every group at once: waits
    alone = replace(probed, reduce_cpu=0.4)  # each group timed alone: 40 % of its SYNC is the node's CPU work
    assert held_out_costs(alone, prior, [1, 1], dp=2).sync_cpu == 0.4
    assert held_out_costs(replace(cal, reduce_cpu=0.4), prior, [1, 1], dp=2).sync_cpu == 0.0  # no probe: a fit link


def test_the_bias_is_taken_against_the_steps_timed_as_the_held_out_plans_are() -> None:
    """The run is the model's to the second (makespan 15 s: 1F1B, 2 ranks, 4 micro-batches of F 1 s and B 2 s,
    12 s a rank plus the 1 + 2 s fill), but its steps timed from a barrier took 16.5, 18 and 19.5 s (what the
    ranks do outside their actions): the bias is 18 / 15 and the spread (18.75 - 17.25) / 2 / 18."""
    prior = fake_profile([3.0, 3.0])
    plan = build_schedule("1f1b", 2, 4)
    run = simulate(plan, prior.cost_model([0, 1, 2])).timeline
    assert run.makespan == 15.0
    cal = calibrate_run([run] * 3, plan, prior, [1, 1], cores=8, steps=[16.5, 18.0, 19.5])
    assert cal.bias == pytest.approx(18.0 / 15.0, rel=1e-9) and cal.spread == pytest.approx(0.75 / 18.0, rel=1e-9)
    assert calibrate_run([run] * 3, plan, prior, [1, 1], cores=8).bias == pytest.approx(1.0, rel=1e-9)
    with pytest.raises(ValueError, match="steps must be measured step seconds > 0"):
        calibrate_run([run], plan, prior, [1, 1], cores=8, steps=[])


def test_the_held_out_error_is_each_stage_predicted_from_the_others() -> None:
    """The layers run 1, 1, 2 and 4x the prior on the calibrating plan's four stages (F and B alike). Leaving a
    stage out, the others' median ratio predicts it: stage 0 from (1, 2, 4) at 2, stage 1 the same, stage 2 from
    (1, 1, 4) at 1, stage 3 from (1, 1, 2) at 1; the error is the root mean square of the logs (F and B count
    alike). One stage: no other to predict it from, the prior's MODEL_ERROR is kept."""
    import math

    from stagewise.planning.recalibrate import MODEL_ERROR, Z85

    prior, truth = fake_profile([3.0] * 4), fake_profile([3.0, 3.0, 6.0, 12.0])
    plan = build_schedule("1f1b", 4, 4)
    run = simulate(plan, truth.cost_model([0, 1, 2, 3, 4])).timeline
    cal = calibrate_run([run] * 3, plan, prior, [1, 1, 1, 1], cores=8)
    logs = [math.log(1 / 2), math.log(1 / 2), math.log(2 / 1), math.log(4 / 1)]
    want = math.sqrt(sum(x * x for x in logs) / 4)
    assert cal.held_out_error == pytest.approx(want, rel=1e-9)
    assert (cal.spread, cal.uncertainty, cal.bias) == (0.0, 0.0, pytest.approx(1.0, rel=1e-9))
    got = cal.predict(plan, cal.profile(prior).cost_model([0, 1, 2, 3, 4]), processes_per_node=4)
    assert got.high == pytest.approx(got.step * math.exp(Z85 * want), rel=1e-9)
    assert got.low == pytest.approx(got.step / math.exp(Z85 * want), rel=1e-9)
    one = build_schedule("1f1b", 1, 2)
    alone = calibrate_run([simulate(one, truth.cost_model([0, 4])).timeline], one, prior, [4], cores=8)
    assert alone.held_out_error == MODEL_ERROR


def test_the_interval_combines_what_the_run_shows_of_the_error() -> None:
    """Steps 0.9, 1.0, 1.1 s (spread 0.05), no stage spread (uncertainty 0), a held-out error of 0.09 and a bias
    of e^0.12 (the model missed the run by 0.12 in log): sqrt(0.05^2 + 0.09^2 + 0.12^2) = sqrt(0.025)."""
    import math

    from stagewise.planning.recalibrate import RunCalibration

    cal = RunCalibration(
        counts=(1,), measured={}, latency=0.0, bandwidth=math.inf, cores=1, steps=(0.9, 1.0, 1.1),
        bias=math.exp(0.12), held_out_error=0.09,
    )  # fmt: skip
    assert cal.spread == pytest.approx(0.05, rel=1e-9) and cal.uncertainty == 0.0
    assert cal.error == pytest.approx(math.sqrt(0.025), rel=1e-9)
