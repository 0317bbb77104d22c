"""A rank held by a CPU quota priced by its cap, not a speed (issue 49 item 4), on synthetic steps and probes
without processes: the decision path of the Replanner (probes -> :class:`Caps` -> the candidates priced by
:func:`priced` -> :class:`Decisions` with its gain rule and cooldown), each step's truth a quota."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import replace

import pytest

from helpers.profiles import fake_profile
from stagewise import build_schedule, simulate
from stagewise.ir import Timeline
from stagewise.planning.capped import held_speed, priced
from stagewise.planning.recalibrate import calibrate_run
from stagewise.planning.replan import Decisions, cap_error, options_for, step_spread
from stagewise.planning.stragglers import CAP_ERROR, LEAST_ERROR, Caps, Detector, lifted, speed_error

PLAN = build_schedule("1f1b", 2, 4)
PRIOR = fake_profile([1.0] * 8)


def timeline(cut: list[int], speeds: list[float]) -> Timeline:
    """PLAN on ``cut`` with each rank's compute divided by its speed."""
    costs = PRIOR.cost_model([0, cut[0], 8])

    def slowed(values: tuple[float, ...]) -> tuple[float, ...]:
        return tuple(x / speeds[PLAN.placement[s]] for s, x in enumerate(values))

    kinds = ("forward", "backward_input", "backward_weight", "backward_full")
    return simulate(PLAN, replace(costs, **{k: slowed(getattr(costs, k)) for k in kinds})).timeline


def busy_share(cut: list[int]) -> float:
    """Rank 1's compute over the step, at full speed."""
    t = timeline(cut, [1.0, 1.0])
    return sum(e.end - e.start for e in t.events if e.rank == 1) / t.makespan


def held_whole(cut: list[int], cap: float) -> float:
    """A quota whose period is short against the actions (a burst outruns it): rank 1 runs at its cap through
    the whole step when its work at full speed is more than ``cap`` of the step, else at full speed (the
    quota run of tests/runtime/test_replanner_guard.py)."""
    return cap if busy_share(cut) > cap else 1.0


def fluid(cut: list[int], cap: float) -> float:
    """A quota spent as the rank needs it within the step: the highest speed whose step gives rank 1 at least
    its work over ``cap`` of wall time (bisected on the simulator's own steps)."""
    t = timeline(cut, [1.0, 1.0])
    need = sum(e.end - e.start for e in t.events if e.rank == 1) / cap
    if t.makespan >= need:
        return 1.0
    lo, hi = cap, 1.0  # at the cap rank 1 alone takes its work over the cap
    for _ in range(12):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if timeline(cut, [1.0, mid]).makespan >= need else (lo, mid)
    return lo


Truth = Callable[[list[int], float], float]
CUTS = [[c, 8 - c] for c in range(1, 8)]


def step_of(truth: Truth, cut: list[int], cap: float) -> float:
    return timeline(cut, [1.0, truth(cut, cap) if cap < 1 else 1.0]).makespan


def share_of_best(truth: Truth, cut: list[int], cap: float) -> float:
    """The best static cut's step over ``cut``'s under ``cap`` (the oracle: every cut swept)."""
    return min(step_of(truth, c, cap) for c in CUTS) / step_of(truth, cut, cap)


CAL = calibrate_run([timeline([4, 4], [1.0, 1.0])] * 5, PLAN, PRIOR, [4, 4], cores=2)


def run(truth: Truth, caps_of: list[float], seed: int, priced_by_cap: bool = True) -> tuple[list[list[int]], list]:
    """The decision path over the steps of ``caps_of`` (rank 1's quota each step): 5 % step noise, probes at
    15 % (log-normal sigma: 0.22-0.31 read at 25 %), every 5 steps while held and at once when named; a decision
    every 5 steps and when a cap moves; cooldown 5; no re-layout cost. The cut in force after each step."""
    rng = random.Random(seed)
    cut, detector, caps = [4, 4], Detector(2), Caps(2)
    decisions = Decisions(cooldown=5)
    steps: list[float] = []
    series: list[float] = []
    cuts, since_probe = [], 0
    for k, cap in enumerate(caps_of):
        noisy = [rng.lognormvariate(0.0, 0.05) for _ in range(2)]
        speed = truth(cut, cap) if cap < 1 else 1.0
        steps = (steps + [timeline(cut, [noisy[0], noisy[1] * speed]).makespan])[-20:]
        series = (series + [noisy[1] * speed / noisy[0]])[-20:]
        named, _ = detector.observe([noisy[0], noisy[1] * speed])
        held = sorted(set(detector.named) | {r for r, c in enumerate(caps.caps()) if c < 1})
        since_probe += 1
        if held and (named or since_probe >= 5):
            since_probe = 0
            shares = [1.0, cap * rng.lognormvariate(0.0, 0.15)]
            free = lifted([0.0 if r in held and r not in named else 1.0 for r in range(2)], shares)
            caps.observe(shares, [r for r in held if r not in free])
            caps.free(free)
            if free:  # taken at full speed: a fresh calibration (its detector empty) starts, as the Replanner's
                detector = Detector(2)
        if not (named or (k + 1) % 5 == 0 or caps.moved()):
            cuts.append(list(cut))
            continue
        speeds = [1.0, detector.speeds()[1]]
        priced_caps = caps.priced_now() if priced_by_cap else [1.0, 1.0]
        current, candidates = options_for(CAL, PRIOR, PLAN, cut, speeds, caps=priced_caps)
        error = cap_error(CAL, PRIOR, [PLAN], current, candidates, speeds, priced_caps, caps.error())
        if priced_caps[1] == 1.0:  # the held rank's measured speed sets the cut: its noise counts
            error = math.hypot(error, speed_error(series) if len(series) >= 3 else 0.0)
        record = decisions.consider(
            k + 1, current, candidates, steps_left=1000, relayout_s=0.0, spread=step_spread(steps),
            speed_error=error,
        )  # fmt: skip
        if record["taken"]:
            cut = list(record["best"]["counts"])
        cuts.append(list(cut))
    return cuts, decisions.log


def test_priced_by_its_cap_a_rank_given_little_work_runs_at_full_speed_and_one_given_much_at_its_cap() -> None:
    """Hand cases of :func:`priced` at 25 % of a core (1F1B, 4 micro-batches, a layer's forward and backward 1 s
    together): on [7, 1] rank 1's 4 s of work fit in a quarter of the 28 s its peer sets (full speed, the step
    unchanged); on [4, 4] its 16 s need a span of 64 s from its first action to its last, and the 4 s of lead-in
    and tail it waits for rank 0 come on top: 68 s, at its cap; with no cap, the speed given is kept."""
    step, speeds = priced(PRIOR, PLAN, [7, 1], [1.0, 0.3], CAL, [1.0, 0.25])
    assert speeds == [1.0, 1.0] and step == pytest.approx(28.0, rel=1e-6)
    step, speeds = priced(PRIOR, PLAN, [4, 4], [1.0, 0.3], CAL, [1.0, 0.25])
    assert step == pytest.approx(68.0, rel=1e-3) and speeds[1] == pytest.approx(0.25, rel=1e-3)
    step, speeds = priced(PRIOR, PLAN, [4, 4], [1.0, 0.5], CAL)
    assert speeds == [1.0, 0.5] and step == pytest.approx(timeline([4, 4], [1.0, 0.5]).makespan, rel=1e-6)


def test_caps_are_the_median_of_two_probes_relative_to_the_largest_and_a_new_level_is_seen_at_once() -> None:
    caps = Caps(2)
    caps.observe([2.0, 0.5], held=[1])
    assert caps.caps() == [1.0, 0.25] and caps.moved() and caps.error() == CAP_ERROR
    assert caps.priced_now() == pytest.approx([1.0, 0.25 * math.exp(-CAP_ERROR)]) and not caps.moved()
    caps.observe([2.0, 0.6], held=[1])  # 0.3: within the noise, the median of the two
    assert caps.caps() == pytest.approx([1.0, 0.275]) and not caps.moved()
    caps.observe([2.0, 0.56], held=[1])  # 0.28: three probes measure their own error (at least LEAST_ERROR)
    assert caps.caps() == pytest.approx([1.0, 0.29]) and LEAST_ERROR <= caps.error() < CAP_ERROR
    caps.observe([2.0, 1.0], held=[1])  # a partial lift to 0.5: a new level, taken at its first probe
    assert caps.caps() == pytest.approx([1.0, 0.5]) and caps.moved() and caps.error() == CAP_ERROR
    caps.observe([2.0, 1.9], held=[1])  # 0.95: above RECOVERED, not a cap
    assert caps.caps() == [1.0, 1.0]
    caps.observe([1.0, 0.5], held=[])
    assert caps.caps() == [1.0, 1.0] and caps.error() == 0.0
    with pytest.raises(ValueError, match="3 probed shares for 2 ranks"):
        caps.observe([1.0, 1.0, 1.0], held=[1])


#: the phases: full speed, 50 %, 25 %, 50 % again (a partial lift), released; (first step, rank 1's cap)
PHASES = ((0, 1.0), (10, 0.5), (30, 0.25), (50, 0.5), (65, 1.0))
STEPS = 80


def caps_of(phases: tuple[tuple[int, float], ...] = PHASES, steps: int = STEPS) -> list[float]:
    return [next(c for start, c in reversed(phases) if k >= start) for k in range(steps)]


#: the share of the best static cut reached by phase step 10: 90 % at a quarter (all of 10 seeds, both truths);
#: at a half 85 %, not 90 %: there [6, 2] (the best) and [7, 1] (85.7 %) differ by 14 %, about the cap's own
#: error from probes at 15 % noise (0.12), and 5 of 10 seeds keep [7, 1] (a first probe read low, or the
#: partial lift's gain refused as inside that error): what is left of the item (docs/benchmarks/stragglers.md)
REACHED = {0.25: 0.9, 0.5: 0.85}


def problems(truth: Truth, seed: int, priced_by_cap: bool = True) -> list[str]:
    """What the run of :data:`PHASES` gets wrong: 10 steps into each throttle (the 25 % phase and the partial
    lift: the decision is made by phase step 10) the cut in force below :data:`REACHED` of the best for it; a
    cut that puts more than the even share on rank 1 while it is held (a flap toward it); 15 steps after the
    release, rank 1 not given back its layers (at least 3 of 8, within 90 % of the best at full speed: a probe
    reading 0.85 at the release is a partial lift, cut for, and the last layer back is a 6 % gain that the gain
    rule may leave to the noise)."""
    cuts, log = run(truth, caps_of(), seed, priced_by_cap)
    out = []
    for (start, cap), (end, _) in zip(PHASES[1:-1], PHASES[2:]):
        reached = cuts[start + 10 - 1]
        if share_of_best(truth, reached, cap) < REACHED[cap]:
            out.append(f"cap {cap} from step {start}: {reached} at phase step 10 is below {REACHED[cap]} of the best")
        if any(c[1] >= 4 for c in cuts[start + 10 - 1 : end]):
            out.append(f"cap {cap} from step {start}: moved back toward rank 1 while held: {cuts[start:end]}")
    back = cuts[PHASES[-1][0] + 15 - 1]
    if back[1] < 3 or share_of_best(truth, back, 1.0) < 0.9:
        out.append(f"released at {PHASES[-1][0]}: {cuts[PHASES[-1][0] :]}")
    return out


@pytest.mark.parametrize("truth", [fluid, held_whole], ids=["fluid", "held-whole"])
def test_a_quota_of_a_half_a_quarter_a_half_again_then_none_is_cut_for_each_within_10_steps(truth: Truth) -> None:
    """50 % -> 25 % decides a cut within 90 % of the best for 25 % by phase step 10; the partial lift 25 % ->
    50 % is cut for (within :data:`REACHED` of the best for 50 %); nothing moves work back onto the held rank;
    released, the layers come back. Two quotas as the truth: spent as needed within the step, or held whole."""
    for seed in range(3):
        assert not problems(truth, seed), (seed, problems(truth, seed))


def test_a_steady_half_never_flaps() -> None:
    """50 % for 50 steps: one move off rank 1, then none (never back to the even cut: priced by the measured
    speed of a cut that leaves rank 1 under its cap, the even cut would look right and be 1.2x slower)."""
    for truth in (fluid, held_whole):
        for seed in range(2):
            cuts, log = run(truth, caps_of(((0, 1.0), (10, 0.5)), 60), seed)
            taken = [r for r in log if r["taken"]]
            assert len(taken) <= 2 and all(c[1] < 4 for c in cuts[20:]), (seed, [(r["step"], r["best"]) for r in taken])


def test_priced_by_a_constant_speed_the_run_goes_wrong() -> None:
    """The mutant: the candidates priced by the held rank's measured speed as a constant factor (the old
    behaviour, caps not given): some phase misses its cut."""
    assert any(problems(truth, seed, priced_by_cap=False) for truth in (fluid, held_whole) for seed in range(3))


def test_a_held_rank_s_speed_is_measured_on_the_cut_it_ran() -> None:
    """What a calibration of a new cut takes for a rank held by a cap (2026-12-03 04:43: told 0.2 by a prediction
    on [8, 2], where the rank ran its two cheap layers at full speed): read on the cut's own steps. One layer under
    a quarter of a core fits under the cap: 1, its layers as measured; four layers held whole at a quarter: the
    cap; a quota that stops the rank between its actions (they run at 0.5 while the rank runs at 0.25): about the
    actions' own speed (the stops before its first action fall outside its span: read a little low)."""
    from helpers.quota import quota

    assert held_speed([timeline([7, 1], [1.0, 1.0])], 1, 0.25, 2.0) == 1.0
    assert held_speed([timeline([4, 4], [1.0, 0.25])], 1, 0.25, 2.0) == pytest.approx(0.25)
    stopped = quota(timeline([4, 4], [1.0, 0.25]), [1.0, 0.5], [1.0, 0.25])
    assert held_speed([stopped], 1, 0.25, 2.0) == pytest.approx(0.5, rel=0.1)
    with pytest.raises(ValueError, match="cap must be in"):
        held_speed([stopped], 1, 0.0, 2.0)


def test_a_capped_speed_is_the_bisection_s_in_a_few_simulations(monkeypatch: pytest.MonkeyPatch) -> None:
    """The capped rank's speed in :func:`priced` (regula falsi, Illinois) is what a bisection to 2^-40 finds, on
    every cut at caps from a tenth to nine tenths, in at most 8 simulations of the step (bisection to the same
    tolerance took 17): a decision with a capped rank prices every candidate cut this way."""
    from stagewise.planning import capped

    found = capped._capped_speed
    calls: list[int] = []

    def counted(step: Callable[..., float], *args: object) -> float:
        n = [0]

        def each(speeds: object) -> float:
            n[0] += 1
            return step(speeds)

        out = found(each, *args)  # type: ignore[arg-type]
        calls.append(n[0])
        return out

    def bisected(step: Callable[..., float], speeds: list[float], r: int, least: float, cap: float) -> float:
        def at(s: float) -> float:
            return step([s if k == r else x for k, x in enumerate(speeds)])

        if at(1.0) >= least:
            return 1.0
        lo, hi = cap, 1.0
        for _ in range(40):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if at(mid) >= least else (lo, mid)
        return lo

    for c in range(1, 8):
        for cap in (0.1, 0.2, 0.25, 0.3, 0.45, 0.5, 0.7, 0.9):
            monkeypatch.setattr(capped, "_capped_speed", bisected)
            want_step, want = priced(PRIOR, PLAN, [c, 8 - c], [1.0, 1.0], CAL, [1.0, cap])
            monkeypatch.setattr(capped, "_capped_speed", counted)
            step, speeds = priced(PRIOR, PLAN, [c, 8 - c], [1.0, 1.0], CAL, [1.0, cap])
            assert speeds[1] == pytest.approx(want[1], rel=1e-4), (c, cap)
            assert step == pytest.approx(want_step, rel=1e-4), (c, cap)
    assert calls and max(calls) <= 8, calls
    assert any(n > 2 for n in calls)  # some caps bind inside the bracket: a root was searched for
