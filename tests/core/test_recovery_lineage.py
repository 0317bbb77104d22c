"""The recovery benchmark's rows made whole (benchmarks/recovery/lineage.py): a row its first writer lost with its
machine is filled from the second writer or from the survivors' resume record, and nothing else is - a real gap,
a rollback or a step resumed twice still shows. Synthetic rows in the shape of steady_train.py's (the quiet run of
2 December 2026 lost the rows of steps 596 and 728 this way and printed 31776 samples skipped)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.recovery import faults
from benchmarks.recovery.lineage import attested, committed_at_failure, job_rows, merged
from benchmarks.recovery.snapshots import median_interval

import recovery_log as rl

B = 24


def row(step: int, time: float, world: int = 6, run: str = "g1") -> rl.Row:
    return {"step": step, "world": world, "time": time, "samples": [B * (step - 1), B * step], "run": run, "loss": 0.0}


def resume(step: int, time: float, world: int = 4, run: str = "g2") -> rl.Row:
    return {"step": step, "world": world, "source": "snapshots", "run": run, "time": time}


# steps 1..5 at 6 processes; step 6 committed, its writer killed before its row (kill at 6.5, in step 7);
# the survivors resume from 6 at 7.0 and train 7..10 at 4 processes
BEFORE = [row(s, float(s)) for s in range(1, 6)]
AFTER = [row(s, 2.0 + s, world=4, run="g2") for s in range(7, 11)]
KILL = rl.Event("kill", 2, 6.5, 4)


def test_a_row_lost_with_its_writer_reads_as_skipped_samples_unless_filled() -> None:
    rows = BEFORE + AFTER
    assert rl.samples_check(rl.lineage(rows)) == {"missing_steps": 1, "skipped": B, "twice": 0}
    assert rl.incident(rows, KILL)["skipped"] == B  # the lost row's samples (from sample 0 before: the 31776)
    whole, filled = attested(rows, [resume(6, 7.0)])
    assert filled == [6]
    line = rl.lineage(whole)
    assert sorted(line) == list(range(1, 11)) and line[6]["samples"] == [B * 5, B * 6]
    assert line[6]["writer"] == "resume" and line[6]["world"] == 6 and line[6]["time"] < KILL.at
    assert rl.samples_check(line) == {"missing_steps": 0, "skipped": 0, "twice": 0}
    got = rl.incident(whole, KILL)
    assert (got["resumed"], got["rolled_back"], got["redone"], got["skipped"], got["twice"]) == (6, 0, 1, 0, 0)


def test_a_real_gap_is_not_filled() -> None:
    rows = BEFORE + [row(s, 2.0 + s, world=4, run="g2") for s in range(8, 11)]  # resumed from 7: 6 never trained
    whole, filled = attested(rows, [resume(7, 7.0)])
    assert filled == [] and len(whole) == len(rows)
    assert rl.samples_check(rl.lineage(whole)) == {"missing_steps": 2, "skipped": 2 * B, "twice": 0}


def test_a_rollback_is_not_hidden() -> None:
    rows = BEFORE + [row(s, 2.0 + s, world=4, run="g2") for s in range(5, 11)]  # resumed from 4: step 5 again
    whole, filled = attested(rows, [resume(4, 7.0)])
    assert filled == []
    got = rl.incident(whole, KILL)
    assert (got["resumed"], got["rolled_back"], got["redone"]) == (4, 1, 2)


def test_a_commit_that_ended_after_the_last_row_counts_when_it_is_rolled_back() -> None:
    """Rows carry the runtime's committed step (the one before theirs); step 5's commit ended after its row, and
    the survivors' record says so: going back to 4 is then a committed step rolled back; going back to 4 when
    step 5 was not committed (the record says 4) is step 5 redone, not rolled back."""
    rows = [{**r, "committed": r["step"] - 1} for r in BEFORE]
    rows += [{**row(s, 2.0 + s, world=4, run="g2"), "committed": s - 1} for s in range(5, 11)]
    for known, rolled in ((5, 1), (4, 0), (None, 0)):
        made = committed_at_failure(rows, [{**resume(4, 7.0), "committed_before": known}])
        got = rl.incident(made, KILL)
        assert (got["resumed"], got["rolled_back"], got["redone"]) == (4, rolled, 2), known
    assert committed_at_failure(BEFORE, [{**resume(4, 7.0), "committed_before": 5}]) == BEFORE  # no field: as is


def test_a_resume_whose_step_has_its_row_fills_nothing() -> None:
    rows = [*BEFORE, row(6, 6.0), *AFTER]
    assert attested(rows, [resume(6, 7.0)]) == (sorted(rows, key=lambda r: r["time"]), [])


def test_the_second_writer_fills_only_what_the_first_lost() -> None:
    second = [{**row(s, s + 0.01), "loss": 1.0} for s in range(1, 7)] + [row(7, 9.01, world=4, run="g2")]
    got = merged(BEFORE + AFTER, second, [resume(6, 7.0)])
    assert [r["step"] for r in got] == list(range(1, 11))
    assert [r["step"] for r in got if r.get("writer") == "last"] == [6]
    assert all(r["loss"] == 0.0 for r in got if r["step"] != 6)  # the first writer's row kept where both wrote


def test_a_second_writers_row_of_a_step_not_committed_is_not_taken() -> None:
    # the first writer's machine stopped in step 6: the last member's train_step(6) returned, but not every
    # stage stepped; the survivors go on from 5 and train 6 again (redone, not rolled back)
    second = [row(6, 6.01)]
    again = [row(s, 2.0 + s, world=4, run="g2") for s in range(6, 11)]
    got = merged(BEFORE + again, second, [resume(5, 7.0), resume(9, 20.0, run="g3")])  # (a later one: not it)
    assert [r.get("writer") for r in got if r["step"] == 6] == [None]  # only the survivors' own step 6
    inc = rl.incident(got, rl.Event("stop", 2, 6.005, 4))
    assert (inc["resumed"], inc["rolled_back"], inc["redone"]) == (5, 0, 1)
    taken = merged(BEFORE + again, second, [resume(6, 7.0)])  # a resume from 6 says step 6 was committed
    assert [r.get("writer") for r in taken if r["step"] == 6] == ["last", None]


def write_job(folder: Path, second: list[rl.Row]) -> None:
    folder.mkdir(parents=True)
    lines = {"0": 0, "1": 0, "2": 0}
    events = [{**KILL.__dict__, "lines": lines}, {"kind": "back", "machine": 2, "at": 11.0, "world": 6, "lines": lines}]
    back = [row(s, 3.0 + s, run="g3") for s in range(11, 14)]  # taken in after step 10, between steps
    files = {
        "steps.jsonl": BEFORE + AFTER + back, "steps.last.jsonl": second, "events.jsonl": events,
        "resumes.jsonl": [resume(6, 7.0), resume(10, 13.5, world=6, run="g3")],
    }  # fmt: skip
    for name, items in files.items():
        (folder / name).write_text("".join(json.dumps(x) + "\n" for x in items))
    for i in range(3):
        (folder / f"machine{i}.log").write_text("")


def test_the_benchmark_reads_a_job_folder_whole(tmp_path: Path) -> None:
    write_job(tmp_path / "job-0", [])
    rows, lost = job_rows(tmp_path / "job-0")
    assert lost == {"second": [], "resume": [6]} and [r["step"] for r in rows] == list(range(1, 14))
    got = faults.analyse(tmp_path, kept=True)
    assert got["samples"] == {"missing_steps": 0, "skipped": 0, "twice": 0} and got["steps"] == 13
    assert got["lost"] == {"second": [], "resume": [6]}
    kill, back = got["incidents"]
    assert (kill["skipped"], kill["redone"], back["redone"], back["rolled_back"]) == (0, 1, 0, 0)
    assert faults.analyse(tmp_path)["incidents"][1]["redone"] == 1  # restarted survivors throw the step away
    assert faults.lost_rows(got["lost"]) == "rows the first writer lost: 1 by resume [6]; "


def test_the_benchmark_prefers_the_second_writers_row(tmp_path: Path) -> None:
    write_job(tmp_path / "job-0", [row(6, 6.0)])
    assert job_rows(tmp_path / "job-0")[1] == {"second": [6], "resume": []}


def test_the_snapshot_costs_interval_is_the_medians_order_statistics() -> None:
    """12 pairs: the 3rd and 10th values (coverage 1 - 2 P(Bin(12, 1/2) <= 2) = 96.1 %); 3 pairs are too few for
    95 %: the whole range, with its own coverage (75 %)."""
    lo, hi, cover = median_interval([float(x) for x in (11, 0, 5, 3, 9, 1, 7, 2, 10, 4, 8, 6)])
    assert (lo, hi) == (2.0, 9.0) and abs(cover - (1 - 2 * 79 / 4096)) < 1e-12
    assert median_interval([3.0, 1.0, 2.0]) == (1.0, 3.0, 0.75)
