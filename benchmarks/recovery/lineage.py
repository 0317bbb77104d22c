"""The rows of a recovery job, made whole before they are counted: pure, no torch, no processes.

steady_train.py's rows (``steps.jsonl``) are written by ONE member of each generation, its first. When the
machine of that member is the one lost, the step it committed last may have no row: the survivors trained it
(every one of them "goes on from step S", and its resume record in ``resumes.jsonl``, written by the new
generation's first member, names S), but the writer was killed between the step and its append. Counted as it
is, such a lineage looks like a step and a batch skipped (issue 48 asks none), and an incident's samples were
counted from 0 (24 x S). Two sources fill the row, both recorded by a survivor, never guessed:

* the second writer (``steps.last.jsonl``, the generation's last member, on another machine): its row of the
  step, where the first writer's is missing and the step is known committed (one row per run and step, the
  first writer's kept);
* the survivors' resume record: it names the step they went on from; when that step is exactly one past the
  last row before it, that step was committed (every stage stepped) and its row is added, its samples the
  next ``[first, end)`` of the script's data contract (step ``s`` trains ``B (s-1) .. B s``, a function of the
  step number: ``lm_data(seed=100 + s)``; the runtime asks the batch of the step after the one resumed).

A step that neither attests (a gap of two, or a resume above a step nobody recorded) stays missing: a real gap.

Rows carry ``committed`` (``Pipeline.committed_step`` when the row was written: every rank's snapshot held on two
machines, usually the step before the row's). A commit that ended after the last row, before the failure, is
in the survivors' resume record (``committed_before``: what the failed generation's pipeline knew last) and is
put on that last row (:func:`committed_at_failure`), so a rollback is counted against everything committed.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

Row = dict[str, Any]

#: the second writer's rows, beside steps.jsonl (steady_train.py, in place)
SECOND = "steps.last.jsonl"


def read_rows(path: Path) -> list[Row]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def merged(first: list[Row], second: list[Row], resumes: Sequence[Row] = ()) -> list[Row]:
    """One row per (run, step): the first writer's, else the second writer's (marked ``"writer": "last"``) when
    the step is known committed: a later row of its run is the first writer's, or the next resume goes on from
    it or after. A row means ``train_step`` returned on its writer, not that every stage stepped: a machine
    stopped mid-step leaves the other writer's row of a step the survivors then train again (not rolled back)."""
    have = {(r["run"], r["step"]) for r in first}
    extra = [
        {**r, "writer": "last"} for r in second if (r["run"], r["step"]) not in have and _committed(r, first, resumes)
    ]
    return sorted([*first, *extra], key=lambda r: r["time"])


def _committed(row: Row, first: list[Row], resumes: Sequence[Row]) -> bool:
    later = any(r["run"] == row["run"] and r["step"] > row["step"] for r in first)
    after = [r for r in resumes if r["time"] > row["time"]]
    return later or (bool(after) and min(after, key=lambda r: r["time"])["step"] >= row["step"])


def attested(rows: list[Row], resumes: list[Row]) -> tuple[list[Row], list[int]]:
    """``rows`` plus the row of each step a resume record names that no row has, when it is the step right after
    the last row written before the resume (module docstring); returns the rows and the steps filled."""
    out, filled = sorted(rows, key=lambda r: r["time"]), []
    for res in sorted(resumes, key=lambda r: r["time"]):
        before = [r for r in out if r["time"] < res["time"]]
        if res["step"] <= 0 or not before:
            continue
        last = before[-1]
        if last["step"] != res["step"] - 1:  # the step has its row, or the gap is more than one row: not filled
            continue
        first, end = last["samples"]
        row = {
            "step": res["step"], "world": last["world"], "time": last["time"] + 1e-6, "run": last["run"],
            "samples": [end, 2 * end - first], "loss": None, "writer": "resume",
        }  # fmt: skip
        out = sorted([*out, row], key=lambda r: r["time"])
        filled.append(res["step"])
    return out, filled


def committed_at_failure(rows: list[Row], resumes: Sequence[Row]) -> list[Row]:
    """``rows`` with each resume record's ``committed_before`` on the last row written before it, where higher
    than the row's own ``committed`` (rows without one are left alone)."""
    out = sorted(rows, key=lambda r: r["time"])
    for res in resumes:
        known = res.get("committed_before")
        before = [i for i, r in enumerate(out) if r["time"] < res["time"]]
        if known is None or not before or out[before[-1]].get("committed") is None:
            continue
        last = out[before[-1]]
        out[before[-1]] = {**last, "committed": max(int(last["committed"]), int(known))}
    return out


def job_rows(folder: Path) -> tuple[list[Row], dict[str, Any]]:
    """A job folder's rows made whole, and what was filled: ``{"second": steps, "resume": steps}`` (the steps
    whose first writer's row is missing, by the source that holds them)."""
    first, resumes = read_rows(folder / "steps.jsonl"), read_rows(folder / "resumes.jsonl")
    rows = merged(first, read_rows(folder / SECOND), resumes)
    rows, filled = attested(committed_at_failure(rows, resumes), resumes)
    second = sorted(r["step"] for r in rows if r.get("writer") == "last")
    return rows, {"second": second, "resume": filled}
