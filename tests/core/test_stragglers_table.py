"""The stragglers benchmark's per-phase shares (benchmarks/stragglers.py, pure): a partial lift (25 % back to
50 %) is a phase of its own, judged against the 50 % sweep, in the order the phases ran."""

from __future__ import annotations

from typing import Any

from benchmarks.stragglers import PARTIAL, shares


def steps_of(phase: str, counts: list[list[int]], seconds: float) -> list[dict[str, Any]]:
    return [{"phase": phase, "seconds": seconds, "counts": c} for c in counts]


def test_the_partial_lift_is_judged_against_the_half_core_sweep_in_the_order_run() -> None:
    oracle = {"50 %": {5: 0.2, 7: 0.1, 9: 0.15}, "25 %": {7: 0.3, 9: 0.12}, "released": {5: 0.1}}
    steps = (
        steps_of("50 %", [[5, 5]] * 2 + [[7, 3]] * 10, 0.1)
        + steps_of("25 %", [[7, 3]] * 2 + [[9, 1]] * 10, 0.12)
        + steps_of(PARTIAL, [[9, 1]] * 3 + [[7, 3]] * 9, 0.125)
        + steps_of("released", [[7, 3]] * 4 + [[5, 5]] * 8, 0.1)
    )
    rows = shares(steps, oracle)
    assert [r["throttle"] for r in rows] == ["50 %", "25 %", PARTIAL, "released"]
    partial = rows[2]
    assert partial["best cut"] == [7, 3] and partial["best s"] == 0.1
    assert partial["share by step 10"] == 0.1 / 0.125
    assert partial["moved back"] == "moved back to [7, 3] at step 4"  # layers back onto the freed rank
    assert rows[3]["moved back"] == "moved back to [5, 5] at step 5"


def test_a_phase_swept_right_after_it_is_judged_against_its_own_sweep() -> None:
    """``--oracle phase``: the partial lift has a sweep of its own (taken seconds after its live steps), which
    wins over the half core's sweep it was judged against when the oracle ran after every phase."""
    oracle = {"50 %": {7: 0.1, 9: 0.15}, PARTIAL: {7: 0.11, 8: 0.105}, "released": {5: 0.1}}
    steps = steps_of("50 %", [[7, 3]] * 12, 0.1) + steps_of(PARTIAL, [[7, 3]] * 12, 0.125)
    partial = shares(steps, oracle)[1]
    assert partial["best cut"] == [8, 2] and partial["best s"] == 0.105
    assert partial["share by step 10"] == 0.105 / 0.125
    assert partial["that cut static s"] == 0.11  # the live cut, from the same sweep
