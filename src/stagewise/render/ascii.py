"""A text Gantt chart: one line per rank, time quantised to fixed-width cells."""

from __future__ import annotations

import math

from ..ir import Event, Kind, Timeline
from .labels import short_label, stages_per_rank

_IDLE = "."
_FILL = "-"
_MAX_SPLIT = 8  # try quanta of min-duration / 1 .. / 8


def render_ascii(timeline: Timeline, width: int = 120) -> str:
    """The timeline as text, one line per rank, at most ``width`` characters a line.

    *Labelled* chart, when the step fits: each cell covers one time quantum
    (the largest fraction 1/k, k <= 8, of the shortest compute action that
    every start and end is a multiple of, else the shortest action itself,
    which is then approximate but drops no action). A cell shows the event
    running at its midpoint; an event over several cells writes its label once and fills the
    rest with ``-``; ``.`` is idle. Labels are ``F3`` (kind, micro-batch), or
    the action's text form ``2F3`` when ranks hold several stages; SYNC and
    STEP with a cost show as ``SY`` / ``ST``. gpipe, p=2, m=2, F = I = W = 1::

        rank 0  F0 F1 .  .  .  B0--- B1---
        rank 1  .  F0 F1 B0--- B1--- .  .

    *Compact* chart, when it does not fit: one character per cell of
    makespan / (width - margin), showing the kind that fills most of the cell
    (``.`` when idle does), e.g. ``FFFF......BFBFBFB.B.B``.

    Communication events (measured timelines) and zero-length events are not
    drawn. Deterministic: the same timeline always gives the same string.
    """
    if width < 1:
        raise ValueError(f"render_ascii: width must be >= 1, got {width}")
    p = timeline.num_ranks
    events = [e for e in timeline.events if not e.action.kind.is_comm and 0 <= e.rank < p and e.end > e.start]
    digits = len(str(max(p - 1, 0)))
    prefixes = [f"rank {r:>{digits}}  " for r in range(p)]
    if not events:
        return "\n".join(prefix.rstrip() for prefix in prefixes)
    with_stage = stages_per_rank(timeline) > 1
    labels = {id(e): _label(e, with_stage) for e in events}
    cell = max((len(labels[id(e)]) for e in events if e.action.kind.is_compute), default=2) + 1
    t0 = min(e.start for e in events)
    span = max(e.end for e in events) - t0
    rows = _by_rank(events, p)
    quantum = _exact_quantum(events, t0, span, max(1, (width - len(prefixes[0])) // cell))
    if quantum is None:
        cols = max(1, width - len(prefixes[0]))
        lines = [_compact_row(row, t0, span / cols, cols) for row in rows]
    else:
        cols = max(1, math.ceil(span / quantum - 1e-9))
        lines = [_labelled_row(row, labels, t0, quantum, cols, cell) for row in rows]
    return "\n".join((prefix + line).rstrip() for prefix, line in zip(prefixes, lines))


def _label(e: Event, with_stage: bool) -> str:
    kind = e.action.kind
    if kind is Kind.SYNC or kind is Kind.STEP:
        return "SY" if kind is Kind.SYNC else "ST"
    return short_label(e, with_stage)


def _letter(e: Event) -> str:
    kind = e.action.kind
    return "Y" if kind is Kind.SYNC else "S" if kind is Kind.STEP else kind.value


def _exact_quantum(events: list[Event], t0: float, span: float, max_cols: int) -> float | None:
    """The largest min-duration / k (k <= 8) that every event boundary is a multiple of, if it fits;
    else min-duration itself if it fits (every event still gets a cell); else None."""
    if span <= 0:
        return 1.0
    durations = [e.duration for e in events if e.action.kind.is_compute]
    base = min(durations) if durations else span
    offsets = {x - t0 for e in events for x in (e.start, e.end)}
    for k in range(1, _MAX_SPLIT + 1):
        quantum = base / k
        if math.ceil(span / quantum - 1e-9) > max_cols:
            break
        if all(abs(x / quantum - round(x / quantum)) < 1e-6 for x in offsets):
            return quantum
    return base if math.ceil(span / base - 1e-9) <= max_cols else None


def _by_rank(events: list[Event], p: int) -> list[list[Event]]:
    rows: list[list[Event]] = [[] for _ in range(p)]
    for e in events:
        rows[e.rank].append(e)
    for row in rows:
        row.sort(key=lambda e: (e.start, e.end, str(e.action)))
    return rows


def _labelled_row(row: list[Event], labels: dict[int, str], t0: float, quantum: float, cols: int, cell: int) -> str:
    cells: list[Event | None] = [None] * cols
    for e in row:
        # the cells whose midpoint t0 + (k + 1/2) q lies in [start, end)
        first = max(0, math.ceil((e.start - t0) / quantum - 0.5))
        stop = min(cols, math.ceil((e.end - t0) / quantum - 0.5))
        for k in range(first, stop):
            cells[k] = e
    out = []
    k = 0
    while k < cols:
        here = cells[k]
        run = 1
        while k + run < cols and cells[k + run] is here:
            run += 1
        if here is None:
            out.append(_IDLE.ljust(cell) * run)
        elif run == 1:
            out.append(labels[id(here)][: cell - 1].ljust(cell))
        else:
            label = labels[id(here)][: run * cell - 1]
            out.append(label + _FILL * (run * cell - 1 - len(label)) + " ")
        k += run
    return "".join(out)


def _compact_row(row: list[Event], t0: float, quantum: float, cols: int) -> str:
    """One character per cell: the letter whose events cover most of the cell, or idle."""
    cover: list[dict[str, float]] = [{} for _ in range(cols)]
    for e in row:
        letter = _letter(e)
        lo, hi = (e.start - t0) / quantum, (e.end - t0) / quantum
        for k in range(max(0, int(lo)), min(cols, math.ceil(hi))):
            share = min(hi, k + 1) - max(lo, k)
            if share > 0:
                cover[k][letter] = cover[k].get(letter, 0.0) + share
    out = []
    for shares in cover:
        idle = 1.0 - sum(shares.values())
        best = max(shares, key=lambda k: (shares[k], -"FBIWYS".index(k)), default=None)  # ties: F, B, I, W order
        out.append(_IDLE if best is None or idle >= shares[best] else best)
    return "".join(out)
