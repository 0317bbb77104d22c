"""Where a chaos run's goodput went: its window cut into labelled stretches of time. Pure, no torch.

Each stretch ``(label, a, b)`` costs what the fault-free jobs would have committed in ``(a, b]`` at the sizes the
schedule asked for, minus the steps of the final lineage committed in it (a row's time is its step's end).
The stretches tile the window, so the costs add up exactly to ``ideal - useful``: nothing is left out.

Per event, in the order things happen (``row``: steady_train.py's step rows; ``resume``: the new generation's
first member's resume row, with its recovery ``seconds`` and ``parts`` and the time its state was ``restored``)::

    loss   [last row, fault]      "redone"          the step in flight, thrown away
           [fault, failure seen]  "detect"          the survivors still wait on the lost machine
    back   [return, join begins]  "newcomer start"  the members train at the old size while the machine boots
                                                     (negative when the old size is the faster one)
    both   the recovery's parts laid end to end from where it began:
           "commit" (a join: the last snapshot finished), "drop" (hold + drop), "agree", "relayout" (group,
           build, take-over / resume), "recovery other" (the rest of its seconds)
           [restored, its row]    "replay save"     the benchmark saves the resumed state for its replay
           [.., first row]        "first step"      the first step at the new size (one step is expected)
           [first row, +K rows]   "after a change"  the next :data:`AFTER` steps (warm-up, allocator)
    else                          "steady"          the rest: the fault-free rate's own error (normalisation)

An event with no row at its size before the next event: ``[event, next event]`` is "not absorbed". Without a
resume row that has ``seconds`` (the restart path) ``[fault, first row]`` is "recovery (restart)".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from recovery_log import Event, Row, lineage

AFTER = 20  # steps after a change counted as its warm-up
PARTS = {"commit": "commit", "hold": "drop", "drop": "drop", "agree": "agree", "group": "relayout",
         "build": "relayout", "resume": "relayout"}  # fmt: skip
ORDER = ("commit", "drop", "agree", "relayout")
Stretch = tuple[str, float, float]


def stretches(rows: list[Row], resumes: list[Row], events: Sequence[Event], began: float, ended: float) -> list[
    list[Stretch]
]:  # fmt: skip
    """Per event, its labelled stretches (module doc), clipped to the window and to the next event."""
    ordered = sorted(rows, key=lambda r: r["time"])
    times = [e.at for e in events][1:] + [ended]
    out, floor = [], began
    for event, until in zip(events, times, strict=True):
        out.append(_monotone(_event(ordered, resumes, event, until, floor), floor, until))
        floor = max([floor, *(b for _, _, b in out[-1])])
    return out


def _event(rows: list[Row], resumes: list[Row], event: Event, until: float, floor: float) -> list[Stretch]:
    after = [r for r in rows if event.at <= r["time"] < until]
    k = next((i for i, r in enumerate(after) if r["world"] == event.world), None)
    if k is None:
        return [("not absorbed", event.at, until)]
    first = after[k]
    resume = next((r for r in resumes if "seconds" in r and event.at <= r["time"] <= first["time"]), None)
    before = [r for r in rows if r["time"] < event.at]
    out: list[Stretch] = []
    if event.loss:
        out.append(("redone", before[-1]["time"] if before else floor, event.at))
    if resume is None:
        out.append(("recovery (restart)", event.at, first["time"]))
    else:
        restored = float(resume.get("restored", resume["time"]))
        t = restored - float(resume["seconds"])
        out.append(("detect" if event.loss else "newcomer start", event.at, t))
        spent = {label: 0.0 for label in ORDER}
        for part, s in resume.get("parts", {}).items():
            if part in PARTS:
                spent[PARTS[part]] += float(s)
        for label in ORDER:
            out.append((label, t, t + spent[label]))
            t += spent[label]
        out.append(("recovery other", t, restored))
        out.append(("replay save", restored, resume["time"]))
        out.append(("first step", resume["time"], first["time"]))
    later = after[k + 1 : k + 1 + AFTER]
    if later:
        out.append(("after a change", first["time"], later[-1]["time"]))
    return out


def _monotone(out: list[Stretch], floor: float, until: float) -> list[Stretch]:
    """Each stretch starts where the last ended and after ``floor`` (the previous event's last), none past
    ``until`` (a part longer than the clocks allow is cut: no time is counted twice)."""
    fixed, t = [], floor
    for label, a, b in out:
        a = max(a, t)
        b = min(max(b, a), until)
        fixed.append((label, a, b))
        t = b
    return fixed


def ledger(rows: list[Row], resumes: list[Row], events: Sequence[Event], spans: list[tuple[float, float, int]],
           rates: dict[int, float]) -> dict[str, Any]:  # fmt: skip
    """By label and by event: seconds, steps lost, and the fault-free steps of those seconds (``ideal``); the
    labels' losses add up to ``ideal - useful`` of the whole window (``steady``: what is left of it)."""
    began, ended = spans[0][0], spans[-1][1]
    done = sorted(r["time"] for r in lineage(rows).values() if began < r["time"] <= ended)
    per_event = stretches(rows, resumes, events, began, ended)
    taken = sorted((a, b) for each in per_event for _, a, b in each if b > a)
    gaps, t = [], began
    for a, b in taken:
        if a > t:
            gaps.append(("steady", t, a))
        t = max(t, b)
    gaps.append(("steady", t, ended))
    totals: dict[str, dict[str, float]] = {}
    events_out = []
    for each in [*per_event, gaps]:
        costs: dict[str, dict[str, float]] = {}
        for label, a, b in each:
            if b <= a:
                continue
            ideal = _ideal(spans, rates, a, b)
            lost = ideal - sum(1 for x in done if a < x <= b)
            for table in (costs, totals):
                got = table.setdefault(label, {"seconds": 0.0, "lost": 0.0, "ideal": 0.0})
                got["seconds"] += b - a
                got["lost"] += lost
                got["ideal"] += ideal
        events_out.append(costs)
    ideal = _ideal(spans, rates, began, ended)
    return {"by_label": totals, "by_event": events_out[:-1], "ideal": ideal, "useful": len(done)}


def _ideal(spans: list[tuple[float, float, int]], rates: dict[int, float], a: float, b: float) -> float:
    return sum(max(0.0, min(b, hi) - max(a, lo)) * rates[w] for lo, hi, w in spans)
