"""Where one rank's measured step went, from its timeline's events (pure: no torch).

A step's events are ``(action text, start, end)`` in seconds from the rank's step start, as
``Pipeline.timeline()`` gives them (compute actions timed from the moment their input was there; a
SEND or RECV is the time posting it). :func:`step_record` sums them the way
``benchmarks.pipeline_breakdown`` does: per compute kind and per (stage, kind), the messages and their
time, SYNC / STEP, the gaps between actions (waiting for the other rank, plus the interpreter's own time
between actions), the head before the first action and the tail after the last.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from stagewise.ir import parse_action

COMPUTE = ("F", "I", "W", "B")


def step_record(events: Iterable[tuple[str, float, float]], wall: float, cpu: float) -> dict[str, Any]:
    """One rank's step: ``wall`` / ``cpu`` seconds of its ``train_step``, and its events summed."""
    kinds = {k: 0.0 for k in COMPUTE}
    per_stage: dict[str, list[float]] = {}  # "F3" -> [seconds, count]
    comm = other = covered = 0.0
    messages = 0
    first, last = float("inf"), 0.0
    for text, start, end in events:
        action = parse_action(text)
        kind, span = str(action.kind), end - start
        covered += span
        first, last = min(first, start), max(last, end)
        if kind in kinds:
            kinds[kind] += span
            cell = per_stage.setdefault(f"{kind}{action.stage}", [0.0, 0])
            cell[0] += span
            cell[1] += 1
        elif action.kind.is_comm:
            comm += span
            messages += 1
        else:
            other += span
    if first == float("inf"):
        first = last = 0.0
    return {
        "wall": wall,
        "cpu": cpu,
        "compute": kinds,
        "per_stage": per_stage,
        "comm": comm,
        "messages": messages,
        "other": other,
        "gaps": max(0.0, (last - first) - covered),
        "head": first,
        "tail": max(0.0, wall - last),
    }


def stage_means(records: Sequence[Sequence[Mapping[str, Any]]]) -> dict[str, float]:
    """Mean seconds of each (kind, stage) action (``"F3"``) over every rank's steps (``records[rank][step]``)."""
    sums: dict[str, list[float]] = {}
    for rank in records:
        for step in rank:
            for key, (seconds, count) in step["per_stage"].items():
                cell = sums.setdefault(key, [0.0, 0])
                cell[0] += seconds
                cell[1] += count
    return {key: s / n for key, (s, n) in sums.items() if n}


def medians(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One rank's medians over its steps, per field (compute per kind too)."""
    out: dict[str, Any] = {}
    for key in ("wall", "cpu", "comm", "messages", "other", "gaps", "head", "tail"):
        out[key] = statistics.median(float(r[key]) for r in records)
    out["compute"] = {k: statistics.median(float(r["compute"][k]) for r in records) for k in COMPUTE}
    return out


def step_times(records: Sequence[Sequence[Mapping[str, Any]]]) -> list[float]:
    """Each timed step's time: the slowest rank's ``train_step`` from the barrier (``records[rank][step]``)."""
    return [max(float(rank[k]["wall"]) for rank in records) for k in range(len(records[0]))]
