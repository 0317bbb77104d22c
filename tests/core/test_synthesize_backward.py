"""The synthesizer charges a full backward B its own cost: it runs B where splitting does not pay, I and W where it
does, and names its baseline as that schedule runs (1F1B with B, not 1F1B with its backward split)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from stagewise.ir import Kind, Schedule
from stagewise.passes import lower
from stagewise.schedules import generate
from stagewise.simulation import CostModel, simulate
from stagewise.synthesis import lower_bound, report_of, synthesize
from stagewise.validate import validate_schedule


def kinds(schedule: Schedule, stage: int | None = None) -> set[Kind]:
    return {a.kind for acts in schedule.ranks for a in acts if stage is None or a.stage == stage} - {Kind.F}


def test_runs_b_where_splitting_does_not_pay() -> None:
    """B costs what I costs (W is free inside B): every split would add W's time. Every backward runs whole, and the
    step is 1F1B's (m + p - 1)(F + B) = 10, the lower bound."""
    costs = CostModel.uniform(2, forward=1.0, backward_input=1.0, backward_weight=1.0, backward_full=1.0)
    got = synthesize(costs, 2, 4)
    validate_schedule(got)
    report = report_of(got)
    assert kinds(got.compute_only()) == {Kind.B}
    assert report.makespan == 10.0 == simulate(got, costs).makespan == report.lower_bound
    assert report.whole_stages == (0, 1) and report.b_actions == 8
    assert report.baseline == "1f1b" and report.baseline_makespan == 10.0
    assert report.hand_written["1f1b, split"] == 14.0  # the same order split pays W on every backward


def test_splits_where_it_pays() -> None:
    """B = 1.9 against I + W = 2 at p = 4, m = 8, 1F1B's memory: ZB-H1's split (27) beats 1F1B's B (31.9); the
    synthesized step is ZB-H1's, with I and W."""
    costs = CostModel.uniform(4, backward_full=1.9)
    got = synthesize(costs, 4, 8, memory=4)
    report = report_of(got)
    assert report.makespan == pytest.approx(27.0) == simulate(generate("zb-h1", 4, 8), costs).makespan
    assert report.hand_written["1f1b"] == pytest.approx(31.9)
    assert report.whole_stages == () and {Kind.I, Kind.W} <= kinds(got.compute_only())


def test_mixes_per_stage_where_that_pays() -> None:
    """B costs half of I + W on the first and last stage and all of it in between: running those two whole and
    splitting the middle reaches the lower bound 26, below every backward whole (1F1B, 30) and every one split
    (ZB-H1, 27)."""
    costs = replace(CostModel.uniform(4), backward_full=(1.0, 2.0, 2.0, 1.0))
    got = synthesize(costs, 4, 8, memory=4)
    validate_schedule(got)
    report = report_of(got)
    assert report.makespan == 26.0 == report.lower_bound == simulate(got, costs).makespan
    assert report.hand_written["1f1b"] == 30.0 and report.hand_written["zb-h1"] == 27.0
    assert report.whole_stages == (0, 3)
    compute = got.compute_only()
    assert kinds(compute, 0) == kinds(compute, 3) == {Kind.B}
    assert {Kind.I, Kind.W} <= kinds(compute, 1) | kinds(compute, 2)


def test_the_baseline_is_the_schedule_as_it_runs() -> None:
    """Where B = I costs less than I + W, 1F1B (B on every backward) runs in 22, ZB-H1 in 27: the baseline is 1F1B at
    22, not 1F1B with its backward split (30), which is a different schedule, reported under its own name."""
    costs = CostModel.uniform(4, backward_full=1.0)
    report = report_of(synthesize(costs, 4, 8, memory=4))
    assert report.baseline == "1f1b"
    assert report.baseline_makespan == 22.0 == simulate(generate("1f1b", 4, 8), costs).makespan
    split = simulate(lower(generate("1f1b", 4, 8), split=True), costs).makespan
    assert report.hand_written["1f1b, split"] == 30.0 == split
    assert report.makespan <= 22.0


def test_with_b_equal_to_i_plus_w_nothing_changes() -> None:
    """A cost model that leaves B out (B = I + W) gives the schedule it gave before B had a cost of its own."""
    costs = CostModel.uniform(4)
    assert synthesize(costs, 4, 8).to_text() == synthesize(replace(costs, backward_full=(2.0,) * 4), 4, 8).to_text()


def test_the_bound_holds_for_every_mix() -> None:
    """The lower bound relaxes each backward to what B or I + W, whichever is cheaper, must take: no registered
    schedule (B or split) beats it."""
    costs = replace(CostModel.uniform(3, backward_input=1.5, backward_weight=0.5), backward_full=(1.2, 2.5, 1.0))
    bound = lower_bound(costs, 3, 6)
    for name in ("gpipe", "1f1b", "zb-h1", "zb-h2"):
        assert bound <= simulate(generate(name, 3, 6), costs).makespan * (1 + 1e-12)
        assert bound <= simulate(lower(generate(name, 3, 6), split=True), costs).makespan * (1 + 1e-12)


def test_cost_rows_may_give_b() -> None:
    rows = [(1.0, 1.0, 1.0, 1.0)] * 2
    assert (
        synthesize(rows, 2, 4).to_text()
        == synthesize(CostModel.uniform(2, backward_full=1.0, weight_activation_bytes=0.5), 2, 4).to_text()
    )


def test_a_stash_larger_than_the_activations_stays_within_the_cap() -> None:
    """W's stash at 1.5 times what the forward saved: I grows the memory. A byte cap holds for the simulated peak,
    and the smallest cap named counts the stash."""
    costs = replace(CostModel.uniform(2), activation_bytes=(2.0, 2.0), weight_activation_bytes=(3.0, 3.0))
    got = synthesize(costs, 2, 4, memory=float("inf"), memory_bytes=6.0)
    assert max(simulate(got, costs).peak_activation_bytes) <= 6.0
    with pytest.raises(ValueError, match="smallest cap that works is 3 bytes"):
        synthesize(costs, 2, 4, memory=float("inf"), memory_bytes=2.5)
