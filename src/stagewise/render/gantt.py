"""One Gantt panel on a matplotlib axes: a window of a timeline, one row per rank, boxes coloured by kind.

A PNG (:mod:`.png`) is one or more panels under one header: a whole timeline,
a long one cut into strips of time, or several timelines stacked on one scale.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..ir import Event, Kind, Timeline
from .labels import DRAWN_KINDS, chunk_index, stages_per_rank, time_scale_name

#: box colours by kind (Tableau-like, distinguishable in grey scale and by most colour-blind readers)
COLORS = {
    Kind.F: "#4E79A7",
    Kind.B: "#E15759",
    Kind.I: "#F28E2B",
    Kind.W: "#59A14F",
    Kind.SYNC: "#6B6B6B",
    Kind.STEP: "#2F2F2F",
}
COMM_COLOR = "#B8B0AC"
IDLE_COLOR = "#F1F1F1"
_BOX_KINDS = frozenset(k.value for k in (Kind.F, Kind.B, Kind.I, Kind.W))

RGB = tuple[float, float, float]


@dataclass(frozen=True)
class Panel:
    """A window ``[start, start + span)`` of ``timeline``, drawn ``width_px`` wide."""

    timeline: Timeline
    start: float
    span: float
    width_px: float
    row_pt: float  # the height of one rank's row, in points

    @property
    def px_per_unit(self) -> float:
        return self.width_px / self.span


def shade(color: str, chunk: int, v: int) -> RGB:
    """Later virtual-stage chunks of a rank are drawn lighter (mixed with white): chunk 0 full, the last half."""
    from matplotlib.colors import to_rgb

    r, g, b = to_rgb(color)
    mix = 0.0 if v <= 1 else 0.5 * chunk / (v - 1)
    return (r + (1 - r) * mix, g + (1 - g) * mix, b + (1 - b) * mix)


def drawn_events(timeline: Timeline) -> list[Event]:
    """What a chart shows: events on existing ranks, compute of positive length (a zero-length W is no box)."""
    return [
        e
        for e in timeline.events
        if 0 <= e.rank < timeline.num_ranks and (e.end > e.start or not e.action.kind.is_compute)
    ]


def draw_panel(ax: Any, panel: Panel, *, x_label: bool) -> list[str]:
    """Draw ``panel`` on ``ax``; returns the kinds drawn (``"F"``, ..., ``"comm"``) in legend order."""
    timeline = panel.timeline
    p = max(timeline.num_ranks, 1)
    v = stages_per_rank(timeline)
    events = [e for e in drawn_events(timeline) if e.end >= panel.start and e.start <= panel.start + panel.span]
    _style_axes(ax, p, panel, time_scale_name(timeline.unit) if x_label else None)
    drawn = _draw_boxes(ax, events, timeline, v, panel.px_per_unit)
    _draw_labels(ax, events, panel, v)
    return drawn


def _style_axes(ax: Any, p: int, panel: Panel, unit: str | None) -> None:
    ax.set_facecolor(IDLE_COLOR)
    room = 3 / panel.px_per_unit  # a final SYNC tick stays visible
    ax.set_xlim(panel.start, panel.start + panel.span + room)
    ax.set_ylim(p - 0.5, -0.5)  # rank 0 on top
    step = 1 if p <= 32 else -(-p // 32)
    ticks = list(range(0, p, step))
    ax.set_yticks(ticks, [f"rank {r}" for r in ticks])
    ax.tick_params(axis="y", length=0, labelsize=9 if p <= 32 else 7)
    ax.tick_params(axis="x", labelsize=9)
    if unit is not None:
        ax.set_xlabel(f"time ({unit})", fontsize=9)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.margins(0)


def _box_groups(events: list[Event], timeline: Timeline, v: int, min_w: float) -> dict[str, list[tuple[Any, ...]]]:
    """(start, end, rank, colour) per legend key; thin bars (SYNC, STEP, waits) get at least ``min_w``."""
    chunks = chunk_index(timeline) if v > 1 else {}
    groups: dict[str, list[tuple[Any, ...]]] = {}
    for e in events:
        kind = e.action.kind
        if kind.is_compute:
            color: RGB | str = shade(COLORS[kind], chunks.get((e.rank, e.action.stage), 0), v)
            groups.setdefault(kind.value, []).append((e.start, e.end, e.rank, color))
        elif kind in COLORS:
            groups.setdefault(kind.value, []).append((e.start, max(e.end, e.start + min_w), e.rank, COLORS[kind]))
        else:
            groups.setdefault("comm", []).append((e.start, max(e.end, e.start + min_w), e.rank, COMM_COLOR))
    return groups


def _draw_boxes(ax: Any, events: list[Event], timeline: Timeline, v: int, px_per_unit: float) -> list[str]:
    """One PolyCollection per kind; returns the legend keys drawn, in order."""
    import numpy as np
    from matplotlib.collections import PolyCollection

    groups = _box_groups(events, timeline, v, 2.0 / px_per_unit)
    compute = sorted(e.duration * px_per_unit for e in events if e.action.kind.is_compute)
    edge = 0.6 if compute and compute[len(compute) // 2] >= 5 else 0.0  # white seams only between visible boxes
    drawn = []
    for key in [k.value for k in DRAWN_KINDS] + ["comm"]:
        boxes = groups.get(key)
        if not boxes:
            continue
        is_box = key in _BOX_KINDS
        half = 0.4 if is_box else 0.1 if key == "comm" else 0.16
        offset = 0.3 if key == "comm" else 0.0  # communication waits: a strip along the row's bottom
        x0 = np.array([b[0] for b in boxes])
        x1 = np.array([b[1] for b in boxes])
        y = np.array([b[2] for b in boxes], dtype=float) + offset
        corners = [(x0, y - half), (x0, y + half), (x1, y + half), (x1, y - half)]
        verts = np.stack([np.stack(c, 1) for c in corners], axis=1)
        ax.add_collection(
            PolyCollection(
                verts,  # type: ignore[arg-type]
                facecolors=[b[3] for b in boxes],
                edgecolors="white",
                linewidths=edge if is_box else 0.0,
                antialiased=edge > 0,
            )
        )
        drawn.append(key)
    return drawn


def _draw_labels(ax: Any, events: list[Event], panel: Panel, v: int) -> None:
    """Micro-batch numbers in the boxes they fit in; with several stages per rank, the stage under it (``s2``)."""
    if panel.row_pt < 7:
        return
    size = max(5.0, min(9.0, panel.row_pt * 0.42))
    char_px = 0.62 * ax.figure.dpi / 72  # the width of a character of 1 pt, roughly
    two_lines = v > 1 and panel.row_pt >= 20  # room for the micro-batch over its stage
    chunks = chunk_index(panel.timeline) if v > 1 else {}
    named = panel.timeline.meta.get("labels")  # e.g. {"1F3": "3v1"}: micro-batch and weight version (async)
    named = named if isinstance(named, dict) else {}
    lo, hi = panel.start, panel.start + panel.span
    for e in events:
        a = e.action
        if not a.kind.is_compute or a.microbatch is None:
            continue
        left, right = max(e.start, lo), min(e.end, hi)  # the part of the box inside the window
        width = (right - left) * panel.px_per_unit
        lines = _label_lines(named.get(str(a)), a.stage, a.microbatch, v, two_lines)
        lines, pt = _fitting(lines, str(a.microbatch), width, size, char_px)
        if not lines:
            continue
        r, g, b = shade(COLORS[a.kind], chunks.get((e.rank, a.stage), 0), v)
        color = "white" if 0.299 * r + 0.587 * g + 0.114 * b < 0.55 else "#1A1A1A"
        x = (left + right) / 2
        if len(lines) == 1:
            ax.text(x, e.rank, lines[0], ha="center", va="center", fontsize=pt, color=color, clip_on=True)
        else:
            ax.text(x, e.rank - 0.14, lines[0], ha="center", va="center", fontsize=pt, color=color, clip_on=True)
            ax.text(x, e.rank + 0.2, lines[1], ha="center", va="center", fontsize=pt * 0.75, color=color, clip_on=True)


def _label_lines(named: object, stage: int, microbatch: int, v: int, two_lines: bool) -> list[str]:
    if isinstance(named, str):
        return [named]
    if v <= 1:
        return [str(microbatch)]
    return [str(microbatch), f"s{stage}"] if two_lines else [f"s{stage}:{microbatch}"]


def _fitting(lines: list[str], short: str, width: float, size: float, char_px: float) -> tuple[list[str], float]:
    """The lines at ``size`` or a little smaller if each fits the box's width (the second line is smaller still),
    else ``short`` (the micro-batch alone), else nothing."""

    def fits(text: str, pt: float) -> bool:
        return len(text) * pt * char_px + 3 <= width

    for pt in (size, max(6.0, size * 0.8)):
        if fits(lines[0], pt) and (len(lines) == 1 or fits(lines[1], pt * 0.75)):
            return lines, pt
    for pt in (size, max(6.0, size * 0.8)):
        if fits(short, pt):
            return [short], pt
    return [], size
