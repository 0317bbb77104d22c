"""What a fault cost an elastic job, read from the rows it logged (steady_train.py's): pure, no torch, no processes.

A row is one committed step: ``{"step", "world", "time", "samples": [first, end), "run", ...}``, written by
rank 0 when ``train_step`` returned. Rows arrive in time order; a row whose step is not above the previous
one's means the job went back (it resumed from an older state): the steps in between were **rolled back**.
The **lineage** is what the final state was trained on: replaying the rows, each row drops every step at or
above its own and takes its place.

For one event (a machine lost, or taken back) at wall time ``at``, expecting ``world`` processes after it:

* ``first``: the first row at that world after ``at`` - the first committed step of the new membership;
  ``to_first_step_s`` is ``first.time - at``; ``pause_s`` the gap before it (the last step committed
  before ``first``, by anyone, to ``first``);
* ``rolled_back``: committed steps trained again: the last step committed before ``first`` minus the step
  it resumed from (``first.step - 1``). Committed is the runtime's definition when the rows carry it
  (``committed``: ``Pipeline.committed_step`` - every rank's snapshot held on two machines - as known when the
  row was written, or at the failure: benchmarks/recovery/lineage.py), else a row's own step;
* ``redone``: the steps a row was written for (``train_step`` returned) and trained again, plus the step in
  flight, when one was thrown away (always on a loss; on a return when the processes changed, ``first.run``
  not the previous row's, unless they were kept in place);
* ``skipped`` / ``twice``: samples between the resumed step's end and ``first``'s start, or before it.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

Row = dict[str, Any]

#: the faults of a loss; a return is "back"
LOSSES = ("kill", "stop", "partition")


@dataclass(frozen=True)
class Event:
    """A fault or a return, done at wall time ``at``, after which ``world`` processes should train."""

    kind: str
    machine: int
    at: float
    world: int

    @property
    def loss(self) -> bool:
        return self.kind in LOSSES


def lineage(rows: list[Row]) -> dict[int, Row]:
    """The rows the final state was trained on, by step (a row drops every step at or above its own)."""
    out: dict[int, Row] = {}
    for row in sorted(rows, key=lambda r: r["time"]):
        for step in [s for s in out if s >= row["step"]]:
            del out[step]
        out[row["step"]] = row
    return out


def samples_check(line: dict[int, Row]) -> dict[str, int]:
    """Steps missing from a lineage, samples it skipped and samples it saw twice (each step's ``[first, end)``
    must start where the previous one ended)."""
    expected, skipped, twice = 0, 0, 0
    for step in sorted(line):
        first, end = line[step]["samples"]
        skipped += max(0, first - expected)
        twice += max(0, expected - first)
        expected = end
    steps = sorted(line)
    missing = (steps[-1] - len(steps)) if steps else 0
    return {"missing_steps": missing, "skipped": skipped, "twice": twice}


def incident(rows: list[Row], event: Event, until: float = math.inf, kept: bool = False) -> dict[str, Any]:
    """What ``event`` cost (module docstring); ``{"recovered": False}`` when no row of its world follows it
    before ``until`` (the next event). ``kept``: the survivors keep their processes (in place), so a return,
    taken in between steps, throws no step away."""
    ordered = sorted(rows, key=lambda r: r["time"])
    found = (r for r in ordered if event.at <= r["time"] < until and r["world"] == event.world)
    first = next(found, None)
    if first is None:
        return {"recovered": False}
    before = [r for r in ordered if r["time"] < first["time"]]
    last = before[-1] if before else None
    committed = max((_committed(r) for r in before), default=0)
    returned = max((r["step"] for r in before), default=0)
    resumed = first["step"] - 1
    line = lineage(before)
    held = [s for s in line if s <= resumed]  # (the resumed step's row, else the last before it: a gap its own size)
    start = line[max(held)]["samples"][1] if held else 0
    rolled = max(0, committed - resumed)
    thrown = event.loss or last is None or (last["run"] != first["run"] and not kept)
    return {
        "recovered": True,
        "to_first_step_s": first["time"] - event.at,
        "pause_s": first["time"] - (last["time"] if last else event.at),
        "resumed": resumed,
        "rolled_back": rolled,
        "redone": max(0, returned - resumed) + int(thrown),
        "skipped": max(0, first["samples"][0] - start),
        "twice": max(0, start - first["samples"][0]),
    }


def _committed(row: Row) -> int:
    """The newest step committed when ``row`` was written: its ``committed`` (the runtime's), else its step."""
    said = row.get("committed")
    return int(row["step"] if said is None else said)


def stale_rows(rows: list[Row]) -> int:
    """Rows written by a run after a newer run had started (a fenced-off process must write none)."""
    started: dict[str, float] = {}
    for row in rows:
        started[row["run"]] = min(started.get(row["run"], math.inf), row["time"])
    return sum(1 for r in rows if any(started[r["run"]] < t < r["time"] for t in started.values()))


def percentiles(values: list[float]) -> dict[str, float]:
    """p50, p95 and max by nearest rank (a small sample: no interpolation)."""
    ordered = sorted(values)
    if not ordered:
        return {"n": 0, "p50": math.nan, "p95": math.nan, "max": math.nan}
    rank = lambda q: ordered[max(0, math.ceil(q * len(ordered)) - 1)]  # noqa: E731
    return {"n": len(ordered), "p50": rank(0.5), "p95": rank(0.95), "max": ordered[-1]}


def schedule(seed: int, duration: float, interval: float, machines: int = 3) -> list[tuple[float, str, int]]:
    """A chaos schedule: ``(seconds from the start, kind, machine)`` every ``interval`` before ``duration``; a loss
    (kill, stop or partition, of a machine up) when all are up, else the machine that is down comes back."""
    rng = random.Random(seed)
    down: int | None = None
    out = []
    for k in range(1, math.ceil(duration / interval)):
        if down is None:
            kind, down = rng.choice(LOSSES), rng.randrange(machines)
            out.append((k * interval, kind, down))
        else:
            out.append((k * interval, "back", down))
            down = None
    return out


def timeline(events: list[Event], start: float, end: float, full: int) -> list[tuple[float, float, int]]:
    """``(from, to, world)``: the membership the events asked for, over ``[start, end]`` (``full`` at first)."""
    out, t, world = [], start, full
    for ev in sorted(events, key=lambda e: e.at):
        out.append((t, ev.at, world))
        t, world = ev.at, ev.world
    out.append((t, end, world))
    return [(a, b, w) for a, b, w in out if b > a]


def goodput(rows: list[Row], spans: list[tuple[float, float, int]], throughput: dict[int, float]) -> dict[str, float]:
    """Steps of the final lineage committed in the spans, over what fault-free jobs of each span's size would
    have committed (``throughput``: steps per second by world size, measured apart)."""
    start, end = spans[0][0], spans[-1][1]
    useful = sum(1 for r in lineage(rows).values() if start <= r["time"] <= end)
    ideal = sum((b - a) * throughput[w] for a, b, w in spans)
    return {"useful_steps": useful, "ideal_steps": ideal, "goodput": useful / ideal if ideal else math.nan}
