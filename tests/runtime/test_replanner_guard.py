"""The Replanner's guard (issue 49 item 3) on synthetic timelines, without processes: a margin drawn from the
steps' own step-to-step spread, so that noise alone never re-cuts and a real slowdown does; and the
prediction after a change is the plan as it runs, its slow rank still slow."""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

import pytest
import torch.distributed as dist

from helpers import fake_pipe
from helpers.profiles import fake_profile
from helpers.quota import quota
from stagewise import build_schedule, simulate
from stagewise.planning.replan import replay
from stagewise.planning.stragglers import SLOW as NAMED_BELOW
from stagewise.runtime import Replanner, RunCalibrator

PRIOR = fake_profile([1.0] * 8)


class FakePipe(fake_pipe.FakePipe):
    """1F1B at 2 ranks over 8 equal layers (:data:`PRIOR`, the run's layer profile)."""

    def __init__(self) -> None:
        super().__init__(build_schedule("1f1b", 2, 4), [4, 4], PRIOR)

    def step(self, speeds: list[float], inside: list[float] | None = None) -> Any:
        """The simulator's timeline of this step: each rank's compute divided by its speed; with ``inside``, each
        rank's actions run at that speed and the rest of its time is lost before each starts (a CPU quota)."""
        self.train_steps += 1
        edges = [0] + [r.stop for r in self.layer_ranges]
        costs = PRIOR.cost_model(edges)

        def slowed(values: tuple[float, ...]) -> tuple[float, ...]:
            return tuple(x / speeds[self.schedule.placement[s]] for s, x in enumerate(values))

        kinds = ("forward", "backward_input", "backward_weight", "backward_full")
        timeline = simulate(self.schedule, replace(costs, **{k: slowed(getattr(costs, k)) for k in kinds})).timeline
        return timeline if inside is None else quota(timeline, inside, speeds)


@pytest.fixture
def one_process_group():
    """A group of one (the Replanner hands its decision round with a collective)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def run(
    seed: int, slow_from: int | None, noise: float, steps: int = 40, until: int | None = None, **options: Any
) -> tuple[FakePipe, Replanner]:
    """``steps`` steps with each rank's speed drawn around 1 (``noise``: the relative sigma, log-normal),
    rank 1 at half speed from step ``slow_from`` (until step ``until``: released)."""
    rng = random.Random(seed)
    pipe = FakePipe()
    options.setdefault("probe_every", 0)  # a slowdown of speed, which the steps show (a cap: capped_run's probe)
    replanner = Replanner(pipe, RunCalibrator(pipe, cores=2), steps=1000, relayout_s=0.0, cooldown=5, **options)
    for k in range(steps):
        speeds = [rng.lognormvariate(0.0, noise) for _ in range(2)]
        if slow_from is not None and k >= slow_from and (until is None or k < until):
            speeds[1] *= 0.5
        replanner.observe(pipe.step(speeds))
    return pipe, replanner


NOISE = 0.1  # each rank's speed spread by 10 % (sigma, log-normal), every step drawn anew: step spreads 3-11 %


@pytest.mark.usefixtures("one_process_group")
def test_noise_alone_never_recuts_and_a_real_slowdown_does() -> None:
    for seed in range(12):
        pipe, quiet = run(seed, None, NOISE)
        assert not [r for r in quiet.log if r["taken"]], (seed, quiet.log)
        assert [len(r) for r in pipe.layer_ranges] == [4, 4]
        pipe, slowed = run(seed, 10, NOISE)
        taken = [r for r in slowed.log if r["taken"]]
        assert taken and taken[0]["step"] <= 10 + 10, (seed, slowed.log)  # within 10 steps of the slowdown
        assert [len(r) for r in pipe.layer_ranges][1] < 4  # layers moved off the slow rank
        assert all(r["spread"] > 0 for r in slowed.log)


@pytest.mark.usefixtures("one_process_group")
def test_without_the_spread_noise_does_recut() -> None:
    """The guard is what holds: with z = 0 (the margin fixed, as before) some noisy run re-cuts."""
    recut = [seed for seed in range(12) if any(r["taken"] for r in run(seed, None, NOISE, z=0.0)[1].log)]
    assert recut


@pytest.mark.usefixtures("one_process_group")
def test_the_prediction_after_a_change_keeps_the_slow_rank_slow() -> None:
    """After the re-cut, the new calibration is told rank 1's speed: report()'s prediction is the step as it
    runs (rank 1 at half speed), within the interval of the steps measured."""
    pipe, replanner = run(0, 10, 0.0, steps=30)
    assert [r for r in replanner.log if r["taken"]]
    report = replanner.calibrator.report()
    assert report["steps"] > 0 and report["error"] == pytest.approx(0.0, abs=1e-9), report
    full_speed = RunCalibrator(pipe, cores=2, warmup=0, after=1)
    full_speed.observe(pipe.step([1.0, 1.0]))
    assert full_speed.prediction is not None
    assert report["predicted_s"] > full_speed.prediction.step * 1.05  # not the full-speed step


SLOW, RELEASED = 10, 25


def wrong_moves(log: list[dict[str, Any]]) -> list[tuple[int, list[int], list[int]]]:
    """The changes a run with rank 1 slow over steps [SLOW, RELEASED) should not make: any before the slowdown,
    one that puts layers on the slow rank while it is slow, after the release any but the one back to the even
    cut, or more than one then (a flap)."""
    out = []
    back = 0
    for r in (r for r in log if r["taken"]):
        step, to = r["step"], r["best"]["counts"]
        after = step > RELEASED
        back += after
        if step <= SLOW or (not after and to[1] > 4) or (after and (to != [4, 4] or back > 1)):
            out.append((step, r["current"]["counts"], to))
    return out


@pytest.mark.usefixtures("one_process_group")
def test_after_a_release_fresh_calibrations_do_not_flap() -> None:
    """Each change starts a fresh calibration of 1 warm-up and 3 steps; at 20 % noise per rank and step those
    disagree by more than the steps' spread says. The margin holds the calibration's own uncertainty (its
    stages' spread over its steps) and the measured speeds' standard error: no wrong move in any seed, while
    without the calibration's part (the guard off) its noise re-cuts the wrong way (seed 0: layers onto rank 1
    at the first decision, before any slowdown; seed 7: after the release [6, 2] -> [3, 5]). The 2x slowdown
    is still re-cut within 10 steps at 10 % noise in every seed with the guard on:
    test_noise_alone_never_recuts_and_a_real_slowdown_does."""
    for seed in range(12):
        _, replanner = run(seed, SLOW, 0.2, steps=50, until=RELEASED)
        assert not wrong_moves(replanner.log), (seed, wrong_moves(replanner.log))
    unguarded = [run(seed, SLOW, 0.2, steps=50, until=RELEASED, guard_calibration=False)[1] for seed in (0, 7)]
    assert all(wrong_moves(r.log) for r in unguarded), [wrong_moves(r.log) for r in unguarded]


#: the phases of the quota run: (first step, rank 1's share of a core); released at the last
PHASES = ((10, 0.5), (25, 0.25), (40, 1.0))


def share_of(step: int) -> float:
    """Rank 1's share of a core at ``step``: 1 before the first phase, then each phase's."""
    return next((s for start, s in reversed(PHASES) if step >= start), 1.0)


def quota_run(seed: int, noise: float, steps: int = 60, **options: Any) -> tuple[FakePipe, Replanner, list]:
    """Rank 1 held by a quota (:data:`PHASES`): its step slowed to the share, its actions only half as much
    (the rest of its time lost between them, as a cgroup quota does); each rank's speed drawn around 1
    (``noise``: log-normal sigma). Returns the cut in force after each step too."""
    rng = random.Random(seed)
    pipe = FakePipe()
    options.setdefault("cooldown", 5)
    options.setdefault("probe_every", 0)  # the quota as a speed here, which the steps show
    replanner = Replanner(pipe, RunCalibrator(pipe, cores=2), steps=1000, relayout_s=0.0, **options)
    cuts = []
    for k in range(steps):
        noisy = [rng.lognormvariate(0.0, noise) for _ in range(2)]
        share = share_of(k)
        speeds = [noisy[0], noisy[1] * share]
        inside = [noisy[0], noisy[1] * min(1.0, 2 * share)]
        replanner.observe(pipe.step(speeds, inside))
        cuts.append([len(r) for r in pipe.layer_ranges])
    return pipe, replanner, cuts


def step_of(cut: list[int], share: float) -> float:
    """The step of ``cut`` with rank 1 at ``share`` (no noise): the oracle's figure."""
    probe = FakePipe()
    probe.relayout(cut)
    return probe.step([1.0, share]).makespan


@pytest.mark.usefixtures("one_process_group")
def test_a_quota_of_a_half_then_a_quarter_is_recut_within_10_steps_and_moved_back_after() -> None:
    """Issue 49 item 4 on synthetic steps at 5 % noise: 10 steps into each throttle the cut in force runs at
    least 90 % of the best static cut's speed for it (the oracle: every static cut under the same share), and
    after the release the cut goes back to the even one; no change but those (4 seeds: 6 until the capped run
    below came, for the suite's time)."""
    for seed in range(4):
        pipe, replanner, cuts = quota_run(seed, 0.05)
        for start, share in PHASES:
            best = min(step_of([c, 8 - c], share) for c in range(1, 8))
            reached = cuts[start + 10 - 1]
            assert best / step_of(reached, share) >= 0.9, (seed, share, reached, replanner.log)
        assert cuts[-1] == [4, 4], (seed, replanner.log)
        taken = [r["step"] for r in replanner.log if r["taken"]]
        assert len(taken) <= 4, (seed, taken)  # one per phase, at most one more to settle


@pytest.mark.usefixtures("one_process_group")
def test_under_a_quota_the_actions_speed_alone_misses_the_quarter(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same run judged by its actions' own speed (a quota leaves them 0.5 at a quarter of a core): the
    quarter's cut is not reached, as in the measured run (named 0.52x at a quarter, the move refused)."""
    from stagewise.planning.stragglers import compute_speeds
    from stagewise.runtime.calibration import from_run

    monkeypatch.setattr(from_run, "rank_speeds", compute_speeds)
    _, _, cuts = quota_run(0, 0.05)
    best = min(step_of([c, 8 - c], 0.25) for c in range(1, 8))
    assert best / step_of(cuts[25 + 10 - 1], 0.25) < 0.9


#: the capped run: rank 1's quota (a share of a core) from step CAPPED, lifted at step LIFTED
CAP, CAPPED, LIFTED = 0.25, 10, 30


def capped_step(pipe: FakePipe, cap: float, noisy: list[float]) -> Any:
    """A step as a quota makes it: a cap on rank 1's share of a core, not a speed. Rank 1 is held to ``cap``
    only when the cut gives it more work than that share of the step at full speed (a rank left little work
    stays under its cap and runs at full speed: what made the measured run's released phase show nothing)."""
    free = FakePipe()
    free.relayout([len(r) for r in pipe.layer_ranges])
    timeline = free.step([1.0, 1.0])
    busy = sum(e.end - e.start for e in timeline.events if e.rank == 1)
    share = cap if busy / timeline.makespan > cap else 1.0
    return pipe.step([noisy[0], noisy[1] * share])


def capped_run(
    seed: int, steps: int = 50, capped_noise: float = 0.05, **options: Any
) -> tuple[Replanner, list[list[int]], list[float]]:
    """Rank 1 capped at :data:`CAP` over steps [CAPPED, LIFTED), 5 % noise (``capped_noise`` while capped); the
    probe reads each rank's cap (1 when lifted). Returns the cut in force after each step and each step's rank-1
    cap."""
    rng = random.Random(seed)
    pipe = FakePipe()
    caps = [CAP if CAPPED <= k < LIFTED else 1.0 for k in range(steps)]
    probe = lambda: [1.0, caps[pipe.train_steps - 1]]  # noqa: E731
    replanner = Replanner(pipe, RunCalibrator(pipe, cores=2), steps=1000, relayout_s=0.0, cooldown=5, probe=probe,
                          **options)  # fmt: skip
    cuts = []
    for k in range(steps):
        noise = capped_noise if CAPPED <= k < LIFTED else 0.05
        replanner.observe(capped_step(pipe, caps[k], [rng.lognormvariate(0.0, noise) for _ in range(2)]))
        cuts.append([len(r) for r in pipe.layer_ranges])
    return replanner, cuts, caps


@pytest.mark.usefixtures("one_process_group")
def test_a_capped_rank_is_moved_back_when_its_quota_lifts_and_not_before() -> None:
    """Issue 49 item 4, the quota as a cap: after the re-cut rank 1 holds one layer and stays under its cap, so
    its steps read alike capped or not; the probe of the held rank sees the lift and the cut goes back to the
    even one within 15 steps; while capped it never moves back (no flap). Without the probe (the speed never
    re-estimated) the cut stays off rank 1 after the lift."""
    for seed in range(2):
        replanner, cuts, _ = capped_run(seed)
        held = cuts[CAPPED + 10 - 1]
        assert held[1] < 4, (seed, cuts)  # re-cut off the capped rank within 10 steps
        assert all(c == held for c in cuts[CAPPED + 10 - 1 : LIFTED]), (seed, cuts)  # no flap while capped
        assert [p for p in replanner.probes if p["lifted"]], replanner.probes
        assert all(not p["lifted"] for p in replanner.probes if p["step"] <= LIFTED), replanner.probes
        assert cuts[LIFTED + 15 - 1] == [4, 4], (seed, cuts, replanner.log)
    _, cuts, _ = capped_run(0, probe_every=0)
    assert cuts[CAPPED + 10 - 1][1] < 4 and cuts[-1] == cuts[CAPPED + 10 - 1], cuts


@pytest.mark.usefixtures("one_process_group")
def test_the_noise_of_the_capped_steps_does_not_hold_the_move_back() -> None:
    """2026-12-04 07:30 (quiet, pinned): steps under a quota read +-30 % (its periods beat against the steps), and
    the speeds' error drawn from them held the first decisions after the lift at "gain below cost" (error 0.29,
    0.21, 0.15): moved back 19 steps after the release. After a lift the capped steps' noise is dropped: at 30 %
    noise while capped, back on the even cut within 10 steps of the lift (seeds 0 and 2 took 16 and 13 before)."""
    for seed in (0, 2):
        replanner, cuts, _ = capped_run(seed, capped_noise=0.3)
        assert cuts[CAPPED + 10 - 1][1] < 4, (seed, cuts)
        assert cuts[LIFTED + 10 - 1] == [4, 4], (seed, cuts, replanner.log)


@pytest.mark.usefixtures("one_process_group")
def test_a_cap_that_is_the_ranks_quota_is_watched_by_the_quota_and_its_lift_seen_the_next_step() -> None:
    """The loop costs 30 ms of every rank a probe (9 ms of a held rank's step at a quarter, 2026-12-04). A held
    rank whose loop reading is its cgroup quota is watched by reading the quotas, every step: no loop while the
    quota stays as the loop read it; when it moves (here, lifted) the loop probes at once, the step after (the
    loop's every 5 steps saw it at step 2-5 of the release). The caps stay the loop's readings. A rank whose quota
    does not explain its cap (unknown here) keeps the loop every few steps. Every step watched (``settled_every=1``;
    a settled run sees the lift at its next watched step: test_watch_cadence)."""
    rng = random.Random(0)
    pipe = FakePipe()
    caps = [CAP if CAPPED <= k < LIFTED else 1.0 for k in range(50)]
    loops: list[int] = []

    def probe() -> list[float]:
        loops.append(pipe.train_steps)
        return [1.0, caps[pipe.train_steps - 1] * 0.96]  # the loop reads a little under the quota

    replanner = Replanner(pipe, RunCalibrator(pipe, cores=2), steps=1000, relayout_s=0.0, cooldown=5, probe=probe,
                          quota_probe=lambda: [1.0, caps[pipe.train_steps - 1]], settled_every=1)  # fmt: skip
    cuts = []
    for k in range(50):
        replanner.observe(capped_step(pipe, caps[k], [rng.lognormvariate(0.0, 0.05) for _ in range(2)]))
        cuts.append([len(r) for r in pipe.layer_ranges])
    assert len(loops) == 2 and loops[1] == LIFTED + 1, (loops, replanner.probes)  # one to find the cap, one at the lift
    assert [p["by"] for p in replanner.probes] == ["due", "a quota moved"], replanner.probes
    assert replanner.probes[-1]["lifted"] == [1] and replanner.probes[0]["shares"][1] == CAP * 0.96
    assert cuts[CAPPED + 10 - 1][1] < 4 and cuts[LIFTED + 10 - 1] == [4, 4], (cuts, replanner.log)
    replanner, _, _ = capped_run(0)  # no quota known: the loop, every few steps
    assert all(p["by"] == "due" for p in replanner.probes) and len(replanner.probes) >= 4, replanner.probes


@pytest.mark.usefixtures("one_process_group")
def test_a_decision_on_a_held_rank_is_priced_by_a_probe_of_its_own_step() -> None:
    """2026-12-03 04:17 (quiet, pinned): the quota deepened from a half to a quarter between two probes, and a
    decision due in between priced the held rank at its old cap; it moved a layer onto it, and the cooldown kept
    the quarter's cut 4 steps away. A decision taken while a rank is held probes first (the mutant without it
    prices steps 5 apart on probes up to 4 steps old)."""
    rng = random.Random(0)
    pipe = FakePipe()
    caps = [1.0] * 10 + [0.5] * 13 + [0.25] * 17
    probe = lambda: [1.0, caps[pipe.train_steps - 1]]  # noqa: E731
    replanner = Replanner(pipe, RunCalibrator(pipe, cores=2), steps=1000, relayout_s=0.0, cooldown=5, probe=probe)
    for k in range(len(caps)):
        replanner.observe(capped_step(pipe, caps[k], [rng.lognormvariate(0.0, 0.05) for _ in range(2)]))
    probed = {p["step"] for p in replanner.probes}
    priced = [r["step"] for r in replanner.log if "caps" in r]
    assert len(priced) >= 3, replanner.log
    assert all(step in probed for step in priced), (priced, sorted(probed))
    deeper = [r for r in replanner.log if "caps" in r and r["step"] > 23]
    assert deeper and all(r["caps"][1] < 0.3 for r in deeper), deeper  # every decision after the change: a quarter


@pytest.mark.usefixtures("one_process_group")
def test_a_lift_seen_by_the_probe_before_a_decision_recalibrates_and_decides_nothing() -> None:
    """The probe a decision takes first may find the quota lifted: a fresh calibration starts (a new calibrator)
    and this step decides nothing; the next decisions move the layers back (04:42: the decision went on, on the
    new calibrator, which had no calibration yet). Held at a quarter for 20 steps, then a decision due between
    two regular probes, at the step the quota lifts (every step watched: the step is set up by hand)."""
    rng = random.Random(1)
    pipe = FakePipe()
    caps = [1.0] * 10 + [0.25] * 20 + [1.0] * 30
    probe = lambda: [1.0, caps[pipe.train_steps - 1]]  # noqa: E731
    replanner = Replanner(pipe, RunCalibrator(pipe, cores=2), steps=1000, relayout_s=0.0, cooldown=5, probe=probe,
                          settled_every=1)  # fmt: skip

    def step(k: int) -> Any:
        return replanner.observe(capped_step(pipe, caps[k], [rng.lognormvariate(0.0, 0.05) for _ in range(2)]))

    for k in range(30):
        step(k)
    assert replanner.caps.caps()[1] < 1 and [len(r) for r in pipe.layer_ranges][1] < 4, replanner.log
    replanner.held.since, replanner._since_decision = 1, replanner.every  # a decision due, no probe due
    before = replanner.calibrator
    assert step(30) is None  # the quota lifted at this step: the decision's own probe sees it, nothing decided
    assert replanner.probes[-1]["lifted"] == [1] and replanner.calibrator is not before
    for k in range(31, len(caps)):
        step(k)
    assert [len(r) for r in pipe.layer_ranges] == [4, 4], replanner.log


#: the falsely named run: rank 0 slowed as a speed over steps 4-9 (named, then freed by a probe); rank 1 held at
#: half a core over steps [QUOTA_FROM, LIFTED), its quota begun before the probe that frees rank 0
QUOTA_FROM, LIFTED = 11, 30


def falsely_named_run(seed: int, quota_from: int = QUOTA_FROM) -> tuple[Replanner, list[list[int]]]:
    """The cut in force after each step of the falsely named run, 5 % noise."""
    rng = random.Random(seed)
    pipe = FakePipe()
    caps = [1.0] * quota_from + [0.5] * (LIFTED - quota_from) + [1.0] * 25
    probe = lambda: [1.0, caps[pipe.train_steps - 1]]  # noqa: E731
    replanner = Replanner(pipe, RunCalibrator(pipe, cores=2), steps=1000, relayout_s=0.0, cooldown=5, probe=probe)
    cuts = []
    for k in range(len(caps)):
        noisy = [rng.lognormvariate(0.0, 0.05) * (0.6 if 4 <= k <= 9 else 1.0), rng.lognormvariate(0.0, 0.05)]
        replanner.observe(capped_step(pipe, caps[k], noisy))
        cuts.append([len(r) for r in pipe.layer_ranges])
    return replanner, cuts


@pytest.mark.usefixtures("one_process_group")
def test_a_probe_taken_for_one_rank_caps_another_it_finds_held() -> None:
    """2026-12-03 07:57 (quiet, pinned): rank 0 was named slow at full speed, and the probe that freed it read
    rank 1 at 0.48 of a core (its quota had begun), but only named ranks took caps; the fresh calibration took
    rank 1's held speed as its baseline. A probe's reading of a rank not yet named caps it: it is held, probed,
    and priced by its cap, so the cut is off it within 10 steps and back to the even cut within 10 steps of the
    lift (the mutant that ignores the reading never probes rank 1 again: [5, 3] or [3, 5] after the lift)."""
    for seed in range(3):
        replanner, cuts = falsely_named_run(seed)
        freed = [p for p in replanner.probes if p["lifted"] == [0]]
        assert freed and 1 not in freed[0]["held"] and freed[0]["shares"][1] == 0.5, replanner.probes  # the case
        assert cuts[QUOTA_FROM + 10 - 1][1] < 4, (seed, cuts, replanner.log)
        assert all(c == [4, 4] for c in cuts[LIFTED + 10 - 1 :]), (seed, cuts, replanner.log)


@pytest.mark.usefixtures("one_process_group")
def test_a_probe_at_a_naming_that_frees_another_rank_decides_nothing_that_step() -> None:
    """The quota begun a step earlier: rank 1 is named by its steps, and the probe its naming takes frees rank 0;
    a fresh calibration starts, and that step decides nothing (it went on to decide on the new calibrator, which
    had no calibration yet: an AssertionError, as at 04:42 on the decision's own probe)."""
    for seed in range(3):
        replanner, cuts = falsely_named_run(seed, quota_from=QUOTA_FROM - 1)
        freed = [p for p in replanner.probes if p["lifted"] == [0]]
        assert freed and 1 in freed[0]["held"], replanner.probes  # the case: the naming's probe frees rank 0
        assert cuts[QUOTA_FROM - 1 + 10 - 1][1] < 4 and cuts[-1] == [4, 4], (seed, cuts, replanner.log)


def once_low(pipe: FakePipe, caps: list[float], after: int) -> Any:
    """A probe reading rank 1 at ``caps`` and rank 0 at a whole core, but for one reading of 0.35 after step
    ``after``."""
    low = [True]

    def probe() -> list[float]:
        k = pipe.train_steps - 1
        once = bool(low) and k >= after
        if once:
            low.clear()
        return [0.35 if once else 1.0, caps[k]]

    return probe


@pytest.mark.usefixtures("one_process_group")
def test_one_low_reading_of_a_free_rank_caps_nothing() -> None:
    """2026-12-03 08:13 (quiet, pinned): the free rank 0 read 0.35 of a core in one probe while rank 1 was held at
    a quarter; capped on that one reading, the cut moved its layers onto the held rank ([8, 2] -> [5, 5]). A rank
    nobody named takes a cap only when the next probe reads it capped again: here it never does, and no layer
    goes back onto rank 1 while it is held (the mutant that caps on one reading: it does)."""
    for seed in range(2):
        rng = random.Random(seed)
        pipe = FakePipe()
        caps = [1.0] * 10 + [0.25] * 30
        probe = once_low(pipe, caps, after=20)  # the first probe after step 20 reads rank 0 at 0.35, once
        replanner = Replanner(pipe, RunCalibrator(pipe, cores=2), steps=1000, relayout_s=0.0, cooldown=5, probe=probe)
        cuts = []
        for k in range(len(caps)):
            replanner.observe(capped_step(pipe, caps[k], [rng.lognormvariate(0.0, 0.05) for _ in range(2)]))
            cuts.append([len(r) for r in pipe.layer_ranges])
        assert any(p["shares"][0] == 0.35 for p in replanner.probes), replanner.probes  # the low reading happened
        after = cuts[10 + 10 - 1 :]
        assert after[0][1] < 4 and all(c[1] <= after[0][1] for c in after), (seed, cuts, replanner.log)
        assert replanner.caps.caps()[0] == 1.0


@pytest.mark.usefixtures("one_process_group")
def test_a_decision_whose_speeds_did_not_move_reuses_the_last_prices() -> None:
    """A decision due while what the last one priced stands (its calibration, its caps, no rank's speed moved past
    its noise) takes the last prices again (``priced_at``: 20-45 ms of rank 0 saved) and draws its margin afresh;
    a rank whose speed moves is priced anew at the next decision due. Held at a half from step 10 (named, re-cut),
    deeper at step 30 without news (already named): priced anew and re-cut within 5 steps of its window filling.
    The mutant that reuses nothing fails the first count, the one that reuses whatever moved the second. Every step
    watched (a settled run reads the deeper slowdown on its next watched step: test_watch_cadence)."""
    rng = random.Random(3)
    pipe = FakePipe()
    replanner = Replanner(pipe, RunCalibrator(pipe, cores=2), steps=1000, relayout_s=0.0, cooldown=5, probe_every=0,
                          settled_every=1)  # fmt: skip
    for k in range(60):
        speeds = [rng.lognormvariate(0.0, 0.01) for _ in range(2)]
        speeds[1] *= 1.0 if k < 10 else 0.5 if k < 30 else 0.3
        replanner.observe(pipe.step(speeds))
    reused = [(r["step"], r["priced_at"]) for r in replanner.log if "priced_at" in r]
    assert [s for s, _ in reused if 23 <= s <= 30] == [27] and len([s for s, _ in reused if s > 42]) >= 2, reused
    assert all(at < step for step, at in reused)
    deeper = [r for r in replanner.log if r["step"] > 30]
    assert deeper and deeper[0]["step"] <= 30 + 5 + 5 and "priced_at" not in deeper[0], replanner.log
    assert deeper[0]["taken"] and deeper[0]["best"]["counts"][1] < replanner.log[0]["current"]["counts"][1]
    assert replay(replanner.log) == replanner.log


def test_a_rank_is_named_with_the_speed_that_named_it() -> None:
    """The line and the record of a rank named slow give the median of the window that named it, not of its
    last 3 steps (2026-12-04 11:12: "rank 1 is slow: it runs at 0.93x" of a rank named below 0.8, its window's
    first steps slow, its last two not)."""
    pipe, events = FakePipe(), []
    calibrator = RunCalibrator(pipe, cores=2, on_event=events.append)
    for speeds in [[1.0, 1.0]] * 5 + [[1.0, 0.5]] * 3 + [[1.0, 0.95]] * 2:
        calibrator.observe(pipe.step(speeds))
    named = [e for e in events if e["event"] == "straggler named"]
    assert [e["rank"] for e in named] == [1], events
    assert named[0]["speed"] < NAMED_BELOW and named[0]["speeds"][1] > 0.9, named  # the window's 0.5; the recent 0.95


def cadence_run(onset: int, deeper: int | None = None, steps: int = 45) -> tuple[Replanner, list[int], list[int]]:
    """A run at 5 % noise whose rank 1 runs at half speed from train step ``onset`` (and at 0.3 from ``deeper``),
    the Replanner at its default cadence: the steps watched, and the steps a straggler was named at."""
    rng = random.Random(onset)
    pipe = FakePipe()
    named: list[int] = []
    calibrator = RunCalibrator(pipe, cores=2)
    calibrator.on_event = lambda r: named.append(pipe.train_steps) if r["event"] == "straggler named" else None
    replanner = Replanner(pipe, calibrator, steps=1000, relayout_s=0.0, cooldown=5, probe_every=0)
    watched = []
    for k in range(1, steps + 1):
        speeds = [rng.lognormvariate(0.0, 0.05) for _ in range(2)]
        speeds[1] *= 1.0 if k < onset else 0.5 if deeper is None or k < deeper else 0.3
        if replanner.cadence.due(k):
            watched.append(k)
        replanner.observe(pipe.step(speeds))
    return replanner, watched, named


@pytest.mark.usefixtures("one_process_group")
@pytest.mark.parametrize("onset", [28, 29, 30])
def test_a_settled_run_is_watched_one_step_in_three_and_a_slowdown_still_named_within_5_steps(onset: int) -> None:
    """Issue 49 item 4, what watching costs: once five watched steps running said nothing new, one step in three
    is watched; a slowdown begun on any step of the three is read at the next watched step, every step is watched
    from then on, and the rank is named within 5 steps of its first slow one (the mutant that never watches every
    step again names it at the 7th-9th) and re-cut within 10."""
    replanner, watched, named = cadence_run(onset)
    quiet = [k for k in watched if 15 <= k < onset]
    assert len(quiet) <= (onset - 15) // 3 + 1, watched  # 13-15 steps before the slowdown, 5 or fewer watched
    assert named and onset <= named[0] <= onset + 4, (named, watched)
    first = min(k for k in watched if k >= onset)
    assert first - onset < 3 and [k for k in watched if first <= k <= named[0]] == list(range(first, named[0] + 1))
    taken = [r["step"] for r in replanner.log if r["taken"]]
    assert taken and taken[0] <= onset + 9, (taken, replanner.log)
    assert replay(replanner.log) == replanner.log


@pytest.mark.usefixtures("one_process_group")
def test_a_named_rank_slowed_further_is_watched_every_step_from_its_first_reading() -> None:
    """A rank named slow, re-cut and settled, slows again (0.5 -> 0.3, already named: no news): its first reading
    past the line of its window's median watches every step again (the mutant that looks only at the named line
    keeps one in three), and the deeper cut comes within 10 steps."""
    replanner, watched, _ = cadence_run(10, deeper=40, steps=52)
    before = [k for k in watched if 27 <= k < 40]
    assert len(before) <= 5, watched  # settled on the first re-cut
    first = min(k for k in watched if k >= 40)
    assert [k for k in watched if first <= k < first + 4] == list(range(first, first + 4)), watched
    deeper = [r for r in replanner.log if r["taken"] and r["step"] >= 40]
    assert deeper and deeper[0]["step"] <= 40 + 9, replanner.log


@pytest.mark.usefixtures("one_process_group")
def test_a_job_larger_than_the_pipeline_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Replicas each read their own pipeline's steps, and a decision, a probe or a re-layout is a collective of the
    whole job: one replica's news would wait on replicas that saw none. Refused when made, naming the sizes and
    what works with replicas; the pipeline's ranks alone are watched (one step in three once settled)."""
    from stagewise.runtime.calibration import lead

    pipe = FakePipe()
    assert Replanner(pipe, RunCalibrator(pipe, cores=2), steps=10).cadence.every == 3
    monkeypatch.setattr(lead, "group_size", lambda group: 2 * pipe.num_ranks)
    with pytest.raises(ValueError, match=r"the job has 4 processes and the pipeline 2 ranks: with replicas.*"
                                         r"RunCalibrator\(pipe\) calibrates"):  # fmt: skip
        Replanner(pipe, RunCalibrator(pipe, cores=2), steps=10)
