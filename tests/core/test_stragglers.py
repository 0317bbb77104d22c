"""A slow rank told apart from a costly layer, on synthetic timelines (issue 49 item 3): one cost model (the
calibrated layers) and a speed per rank; named within a window of steps; the cut for the speeds measured."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from helpers.profiles import fake_profile
from helpers.quota import late_sends, quota
from stagewise import build_schedule, simulate
from stagewise.ir import Kind
from stagewise.planning.recalibrate import calibrate_run
from stagewise.planning.stragglers import (
    LEAST_ERROR,
    SLOW,
    WINDOW,
    Detector,
    Straggler,
    compute_speeds,
    cut_for_speeds,
    rank_speeds,
    speed_error,
    speeds_moved,
)

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


def test_a_quota_stops_a_rank_outside_its_actions_and_its_speed_still_shows() -> None:
    """Rank 1 at a quarter of its speed whose compute actions run at half speed (the quota stops it between them
    as often as inside): its speed is 0.25 from when each action could start; its actions alone say 0.5."""
    cal = calibrated()
    held = quota(run([1.0, 0.25]), [1.0, 0.5], [1.0, 0.25])
    assert held.makespan == pytest.approx(run([1.0, 0.25]).makespan)
    assert rank_speeds(held, cal, 2) == pytest.approx([1.0, 0.25])
    assert compute_speeds(held, cal, 2) == pytest.approx([1.0, 0.5])
    # a wait for a peer's output is not slowness: rank 0 idle while rank 1 is slow keeps speed 1
    assert rank_speeds(run([1.0, 0.25]), cal, 2)[0] == pytest.approx(1.0)


def test_a_slow_ranks_late_sends_are_its_own_time_not_its_peers() -> None:
    """Rank 1 at a quarter of its speed, stopped after each action before the send of its output (as a 10 ms
    quota period stops a process: 7-9 ms gaps between an action and its send at 25 %): its peer waits for
    those sends. Read from the sends, rank 0 keeps speed 1, rank 1 reads about 0.25 (the stall after its last
    action is in no span: 0.29), the running step is predicted within 12 % and the cut is the one for the
    true speeds; read from the producers' ends (no sends), rank 0 reads 0.33, rank 1 relative to it 0.86, and
    the step is predicted at a third of what it ran (the 25 % straggler's miss: 150 ms predicted, 220 run)."""
    cal = calibrated()
    layers = cal.profile(PRIOR)
    held = late_sends(run([1.0, 0.25]), [1.0, 1.0], [1.0, 0.25], last=1)
    assert held.makespan == pytest.approx(run([1.0, 0.25]).makespan)
    speeds = rank_speeds(held, cal, 2)
    assert speeds[0] == pytest.approx(1.0) and 0.25 <= speeds[1] < 0.3
    counts, now, _ = cut_for_speeds(layers, PLAN, [4, 4], speeds, cal)
    assert now == pytest.approx(held.makespan, rel=0.12)
    assert counts == cut_for_speeds(layers, PLAN, [4, 4], [1.0, 0.25], cal)[0] == [7, 1]
    blind = replace(held, events=[e for e in held.events if e.action.kind not in (Kind.SEND_F, Kind.SEND_B)])
    old = rank_speeds(blind, cal, 2)
    assert old[0] < 0.5 and old[1] / old[0] > 0.8
    assert cut_for_speeds(layers, PLAN, [4, 4], [1.0, old[1] / old[0]], cal)[1] < held.makespan / 2


def test_a_rank_stopped_before_its_sends_is_named_within_5_steps_in_one_line() -> None:
    """The late sends' quota (above) from step 2: rank 1 named on the third slow step, never rank 0 (which only
    waits for it), in one line with its measured slowdown."""
    cal, detector = calibrated(), Detector(2)
    held = late_sends(run([1.0, 0.25]), [1.0, 1.0], [1.0, 0.25], last=1)
    said = [detector.observe(rank_speeds(t, cal, 2)) for t in [run([1.0, 1.0])] * 2 + [held] * 5]
    named = [(k, slow) for k, (slow, _) in enumerate(said) if slow]
    assert named == [(4, [1])] and 4 - 2 < 5
    speeds = detector.speeds()
    line = Straggler(1, speeds[1], tuple(speeds), (7, 1), 0.068, 0.03).line()
    assert "\n" not in line and "rank 1 is slow" in line and f"({1 / speeds[1]:.2f}x slower" in line
    assert f"the ranks' recent speeds {[round(s, 2) for s in speeds]})" in line  # (it said "the last 3: speeds")
    assert 3.4 < 1 / speeds[1] < 4.0  # the slowdown measured: about 4x (the stall after its last action unread)


def test_the_speeds_standard_error_is_small_when_they_agree_and_ignores_a_throttle_starting() -> None:
    """Hand-computed: speeds alternating 0.5 and 0.6 differ by log 1.2 each step: sigma log 1.2 / 0.954, times
    1.25 / sqrt 3 (a median of the last 3), the same at any level; a level shift from 1.0 to 0.5 is one
    difference the median outvotes."""
    alternating = [0.5, 0.6] * 5
    assert speed_error(alternating) == pytest.approx(1.25 * math.log(1.2) / 0.954 / math.sqrt(3))
    assert speed_error([2 * x for x in alternating]) == pytest.approx(speed_error(alternating))
    shifted = [1.0] * 8 + [0.5] * 8
    assert speed_error(shifted) == LEAST_ERROR  # consistent speeds: the floor, the shift not taken for noise
    assert speed_error([0.5, 0.5]) == math.inf


def test_lifted_names_the_held_ranks_whose_probed_share_is_back() -> None:
    """A rank held slow whose probe reads as much of a core as the largest (within RECOVERED) is free; one held
    at a quarter is not, nor a rank not held; a machine loaded alike lowers every share and frees it still."""
    from stagewise.planning.stragglers import lifted

    assert lifted([1.0, 0.25, 0.3], [1.0, 0.97, 0.26]) == [1]
    assert lifted([1.0, 0.25], [0.3, 0.29]) == [1]  # every share low alike: a loaded machine, not a quota
    assert lifted([1.0, 0.25], [1.0, 0.9]) == []  # 0.9 is not above RECOVERED: still held
    assert lifted([0.85, 0.5], [1.0, 1.0]) == [1]  # 0.85 is not held (SLOW 0.8)
    assert lifted([0.5, 0.5], [0.0, 0.0]) == []
    with pytest.raises(ValueError, match="one per rank"):
        lifted([1.0, 0.25], [1.0])


def test_a_peer_disturbed_during_one_probe_does_not_free_a_held_rank() -> None:
    """The 2026-12-03 03:02 run: rank 0, free, read 0.7 of its usual share in one probe (it shared its core for a
    moment) while rank 1 sat at half a core; read against that probe's largest, rank 1 looked free and the layers
    moved back onto it. Against the reference (the largest of the last probes) it stays held, its cap a half; a
    machine loaded for longer lowers the reference within REFERENCE_PROBES probes and frees it."""
    from stagewise.planning.stragglers import REFERENCE_PROBES, Caps, lifted, reference

    probes = [[1.0, 0.5], [0.98, 0.5], [0.7, 0.66]]  # the last: rank 0 disturbed, rank 1's window read high-ish
    caps = Caps(2)
    for shares in probes:
        top = caps.reference(shares)
        assert lifted([1.0, 0.5], shares, top) == []
        caps.observe(shares, [1], top)
    assert lifted([1.0, 0.5], probes[-1]) == [1]  # the mutant: against the probe's own largest
    assert caps.caps()[1] == pytest.approx((0.5 + 0.66) / 2)  # the median of its last two, read against 1.0
    loaded = [0.6, 0.58]  # every rank at 0.6 from now on: the reference follows
    for k in range(REFERENCE_PROBES):
        freed = lifted([1.0, 0.5], loaded, caps.reference(loaded))
        assert freed == ([1] if k == REFERENCE_PROBES - 1 else [])
    assert reference([]) == 0.0


def test_a_probe_caps_the_ranks_it_finds_held_that_nobody_named() -> None:
    """A probe's share below SLOW of the reference is a quota (the 07:57 run's rank 1 at 0.48); a rank already
    held is the Caps' business; a machine loaded alike (every share low, the reference with them) caps none."""
    from stagewise.planning.stragglers import capped_by_probe

    assert capped_by_probe([0.99, 0.48], [], 0.99) == [1]
    assert capped_by_probe([0.99, 0.48], [1], 0.99) == []
    assert capped_by_probe([0.99, 0.81 * 0.99], [], 0.99) == []  # just above SLOW of the reference
    assert capped_by_probe([0.99, 0.79 * 0.99], [], 0.99) == [1]
    assert capped_by_probe([0.5, 0.49], [], 0.5) == []  # two ranks sharing one core: each a half, both free
    assert capped_by_probe([0.9, 0.3, 0.2], [0], 1.0) == [1, 2]
    assert capped_by_probe([0.0, 0.0], [], 0.0) == []
    assert SLOW == 0.8  # the thresholds above are read against it


def test_a_speed_moved_past_its_noise_is_told_from_one_inside_it() -> None:
    assert not speeds_moved([1.0, 0.5], [1.0, 0.5], [0.0, 0.0])
    bound = 1.44 * 2**0.5 * 0.05  # z x sqrt 2 x the error: two readings
    assert not speeds_moved([1.0, 0.5], [1.0, 0.5 * (1 + 0.99 * bound)], [0.0, 0.05])
    assert speeds_moved([1.0, 0.5], [1.0, 0.5 * (1 + 1.01 * bound)], [0.0, 0.05])
    assert speeds_moved([1.0, 0.5], [1.0, 0.5 * (1 - 1.01 * bound)], [0.0, 0.05])  # either way
    floor = 1.44 * 2**0.5 * LEAST_ERROR  # an error under the least granted is granted the least
    assert not speeds_moved([1.0], [1 + 0.99 * floor], [0.0]) and speeds_moved([1.0], [1 + 1.01 * floor], [0.0])
    assert speeds_moved([0.0, 1.0], [0.0, 1.0], [0.1, 0.1])  # no reading to compare with: moved


def test_an_input_from_the_same_machine_arrives_at_the_local_link_s_latency() -> None:
    """Rank 1 stopped 2.9 s after its input arrived over loopback (0.1 s after rank 0's F ended), then computing
    1 s: its own time is 3.9 s. At the network's 10 s the input would not have been there before the action
    started, and the stop was not counted (1 s); on two machines it is not."""
    from stagewise.ir import Action, Event, Timeline
    from stagewise.planning.own_time import own_spans

    events = [Event(0, Action(0, Kind.F, 0), 0.0, 1.0), Event(1, Action(1, Kind.F, 0), 4.0, 5.0)]
    timeline = Timeline("gpipe", 2, events, source="measured")
    near = own_spans(timeline, 8.0, latency=10.0, nodes=(0, 0), local=0.1)
    assert [own for _, own in near] == pytest.approx([1.0, 3.9])
    assert [own for _, own in own_spans(timeline, 8.0, latency=10.0, nodes=(0, 1), local=0.1)] == [1.0, 1.0]
    assert [own for _, own in own_spans(timeline, 8.0, latency=10.0)] == [1.0, 1.0]


def test_rank_speeds_read_each_input_on_its_own_link() -> None:
    """The quota case above with the calibration's network link at 10 s: both ranks on one machine (the local
    link, 0 s) still read 0.25 for rank 1; read at the network's latency, its stop after the first arrival of
    each step is not counted and it reads faster (0.26)."""
    cal = replace(calibrated(), latency=10.0, local=(0.0, math.inf), nodes=(0, 0))
    held = quota(run([1.0, 0.25]), [1.0, 0.5], [1.0, 0.25])
    assert rank_speeds(held, cal, 2) == pytest.approx([1.0, 0.25])
    assert rank_speeds(held, replace(cal, nodes=(0, 1)), 2)[1] > 0.255
