"""What a fault cost, read from an elastic job's rows (tests/system/scripts/recovery_log.py): rows written by hand
for the paths a recovery can take - the survivors restarted from an older snapshot, kept in place, a data
position resumed wrong, a woken process writing on - and what the benchmark must read from each."""

from __future__ import annotations

import pytest

import recovery_log as rl

B = 24


def row(step: int, time: float, world: int = 6, run: str = "a", first: int | None = None) -> rl.Row:
    start = B * (step - 1) if first is None else first
    return {"step": step, "world": world, "time": time, "samples": [start, start + B], "run": run, "loss": 0.0}


def test_a_restart_from_an_older_snapshot_rolls_back_committed_steps() -> None:
    rows = [row(s, float(s)) for s in range(1, 8)]  # 7 steps committed at 6 processes, then a loss at 7.5
    rows += [row(s, 20.0 + s, world=4, run="b") for s in range(6, 10)]  # resumed from step 5
    got = rl.incident(rows, rl.Event("kill", 2, 7.5, 4))
    assert got["recovered"] and got["resumed"] == 5
    assert (got["rolled_back"], got["redone"]) == (2, 3)  # steps 6 and 7, and step 8 in flight
    assert got["to_first_step_s"] == pytest.approx(26.0 - 7.5) and got["pause_s"] == pytest.approx(26.0 - 7.0)
    assert (got["skipped"], got["twice"]) == (0, 0)
    line = rl.lineage(rows)
    assert sorted(line) == list(range(1, 10)) and line[6]["run"] == "b"
    assert rl.samples_check(line) == {"missing_steps": 0, "skipped": 0, "twice": 0}


def test_survivors_kept_in_place_redo_only_the_step_in_flight() -> None:
    rows = [row(s, float(s)) for s in range(1, 8)] + [row(s, 10.0 + s, world=4) for s in range(8, 11)]
    got = rl.incident(rows, rl.Event("partition", 1, 7.5, 4))
    assert (got["resumed"], got["rolled_back"], got["redone"]) == (7, 0, 1)


def test_a_step_that_returned_but_was_not_committed_is_redone_not_rolled_back() -> None:
    """The rows say what the runtime committed (``committed_step``): step 7 returned (its row) with step 6
    committed; the survivors went on from 6. Step 7 is redone (with step 8, in flight), nothing committed rolled
    back; had step 7 been committed when the loss came (its resume record says so: lineage.py puts it on the
    last row), going back to 6 rolls back one."""
    rows = [{**row(s, float(s)), "committed": s - 1} for s in range(1, 8)]
    rows += [{**row(s, 10.0 + s, world=4, run="b"), "committed": s - 1} for s in range(7, 10)]
    got = rl.incident(rows, rl.Event("partition", 0, 7.5, 4))
    assert (got["resumed"], got["rolled_back"], got["redone"]) == (6, 0, 2)
    rows[6]["committed"] = 7
    assert rl.incident(rows, rl.Event("partition", 0, 7.5, 4))["rolled_back"] == 1


def test_a_return_that_keeps_the_processes_redoes_nothing() -> None:
    rows = [row(s, float(s), world=4) for s in range(1, 6)] + [row(s, 1.0 + s) for s in range(6, 9)]
    got = rl.incident(rows, rl.Event("back", 2, 3.5, 6))
    assert (got["rolled_back"], got["redone"]) == (0, 0)
    joined = [{**r, "run": "b"} if r["world"] == 6 else r for r in rows]  # a new generation, same processes
    assert rl.incident(joined, rl.Event("back", 2, 3.5, 6))["redone"] == 1  # restarted: the step in flight
    assert rl.incident(joined, rl.Event("back", 2, 3.5, 6), kept=True)["redone"] == 0
    assert got["pause_s"] == pytest.approx(2.0) and got["to_first_step_s"] == pytest.approx(7.0 - 3.5)


def test_a_wrong_data_position_is_counted_as_skipped_or_twice() -> None:
    rows = [row(s, float(s)) for s in range(1, 5)]
    ahead = rows + [row(5, 9.0, world=4, run="b", first=B * 5)]  # step 5 trained on step 6's samples
    behind = rows + [row(5, 9.0, world=4, run="b", first=B * 3 + 5)]
    assert rl.incident(ahead, rl.Event("kill", 0, 4.5, 4))["skipped"] == B
    assert rl.incident(behind, rl.Event("kill", 0, 4.5, 4))["twice"] == B - 5
    assert rl.samples_check(rl.lineage(ahead))["skipped"] == B


def test_a_resumed_step_without_its_row_counts_the_gap_from_the_last_row() -> None:
    rows = [row(s, float(s)) for s in range(1, 5)] + [row(s, 9.0 + s, world=4, run="b") for s in (6, 7)]
    got = rl.incident(rows, rl.Event("kill", 0, 4.5, 4))  # resumed at 5, whose row was never written
    assert got["resumed"] == 5 and (got["skipped"], got["twice"]) == (B, 0)  # step 5's samples, not all from 0


def test_no_row_of_the_new_size_before_the_next_event_is_not_recovered() -> None:
    rows = [row(s, float(s)) for s in range(1, 5)] + [row(5, 30.0, world=4, run="b")]
    assert rl.incident(rows, rl.Event("stop", 1, 4.5, 4), until=20.0) == {"recovered": False}
    assert rl.incident(rows, rl.Event("stop", 1, 4.5, 4))["recovered"]


def test_rows_of_a_run_written_after_a_newer_run_started_are_stale() -> None:
    rows = [row(1, 1.0), row(2, 2.0), row(2, 5.0, world=4, run="b"), row(3, 6.0, run="a"), row(3, 7.0, run="b")]
    assert rl.stale_rows(rows) == 1


def test_percentiles_by_nearest_rank() -> None:
    got = rl.percentiles([float(v) for v in range(1, 21)])
    assert (got["n"], got["p50"], got["p95"], got["max"]) == (20, 10.0, 19.0, 20.0)
    assert rl.percentiles([3.0])["p95"] == 3.0


def test_the_schedule_is_seeded_and_alternates_a_loss_and_its_return() -> None:
    plan = rl.schedule(43, 600, 60)
    assert plan == rl.schedule(43, 600, 60) and [t for t, _, _ in plan] == [60 * k for k in range(1, 10)]
    for (_, kind, machine), (_, after, back) in zip(plan[::2], plan[1::2], strict=False):
        assert kind in rl.LOSSES and (after, back) == ("back", machine)
    assert {k for _, k, _ in plan} == {*rl.LOSSES, "back"}


def test_goodput_against_the_fault_free_rate_of_each_size() -> None:
    events = [rl.Event("kill", 2, 10.0, 4), rl.Event("back", 2, 20.0, 6)]
    spans = rl.timeline(events, 0.0, 30.0, 6)
    assert spans == [(0.0, 10.0, 6), (10.0, 20.0, 4), (20.0, 30.0, 6)]
    rows = [row(s, s - 0.5) for s in range(1, 11)] + [row(s, 5.0 + s, world=4, run="b") for s in range(9, 15)]
    got = rl.goodput(rows, spans, {6: 1.0, 4: 0.5})
    assert got["ideal_steps"] == pytest.approx(25.0) and got["useful_steps"] == 14
