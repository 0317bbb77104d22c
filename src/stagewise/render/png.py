"""A Gantt chart of a timeline as a PNG image, in the style of the GPipe / PipeDream figures."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..ir import Event, Kind, Timeline
from .labels import DRAWN_KINDS, KIND_NAMES, chunk_index, stages_per_rank, time_scale_name

#: box colours by kind (Tableau-like, distinguishable in grey scale and by most colour-blind readers)
COLORS = {
    Kind.F: "#4E79A7",
    Kind.B: "#E15759",
    Kind.I: "#F28E2B",
    Kind.W: "#59A14F",
    Kind.SYNC: "#6B6B6B",
    Kind.STEP: "#2F2F2F",
}
_COMM_COLOR = "#B8B0AC"
_BOX_KINDS = frozenset(k.value for k in (Kind.F, Kind.B, Kind.I, Kind.W))
_IDLE_COLOR = "#F1F1F1"

_FIG_WIDTH = 14.0  # inches
_LEFT, _RIGHT, _TOP, _BOTTOM = 0.85, 0.25, 1.05, 0.55  # margins, inches


def render_png(timeline: Timeline, path: str | Path, *, title: str | None = None, dpi: int = 110) -> Path:
    """Draw ``timeline`` as a Gantt chart (one row per rank, rank 0 on top) and save it as PNG.

    Boxes are coloured by kind (F, B, I, W; SYNC and STEP as thin bars) and
    carry their micro-batch number, or ``s{stage}:{micro-batch}`` when ranks
    hold several stages (later chunks of a rank are drawn lighter); a label
    that does not fit its box is shortened to the micro-batch, then dropped.
    The title gives the schedule, the bubble share and the makespan. Works
    the same for simulated (cost units) and measured (seconds) timelines.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    p = max(timeline.num_ranks, 1)
    row_h = 0.42 if p <= 16 else max(0.07, min(0.42, 13.0 / p))
    height = _TOP + _BOTTOM + p * row_h
    fig = Figure(figsize=(_FIG_WIDTH, height), dpi=dpi)
    FigureCanvasAgg(fig)
    ax = fig.add_axes(
        (
            _LEFT / _FIG_WIDTH,
            _BOTTOM / height,
            1 - (_LEFT + _RIGHT) / _FIG_WIDTH,
            p * row_h / height,
        )
    )
    events = [e for e in timeline.events if 0 <= e.rank < timeline.num_ranks]
    t0 = min((e.start for e in events), default=0.0)
    span = max((e.end for e in events), default=1.0) - t0
    span = span if span > 0 else 1.0
    px_per_unit = (_FIG_WIDTH - _LEFT - _RIGHT) * dpi / span
    v = stages_per_rank(timeline)
    _style_axes(ax, p, t0, span + 3 / px_per_unit, timeline.unit)  # room for a final SYNC tick
    drawn = _draw_boxes(ax, events, timeline, v, px_per_unit)
    _draw_labels(ax, events, timeline, v, px_per_unit, row_h * 72)
    _title_and_legend(fig, timeline, title, v, drawn)
    path = Path(path)
    fig.savefig(path, format="png", dpi=dpi, facecolor="white")
    return path


def _style_axes(ax: Any, p: int, t0: float, span: float, unit: str) -> None:
    ax.set_facecolor(_IDLE_COLOR)
    ax.set_xlim(t0, t0 + span)
    ax.set_ylim(p - 0.5, -0.5)  # rank 0 on top
    step = 1 if p <= 32 else -(-p // 32)
    ticks = list(range(0, p, step))
    ax.set_yticks(ticks, [f"rank {r}" for r in ticks])
    ax.tick_params(axis="y", length=0, labelsize=9 if p <= 32 else 7)
    ax.tick_params(axis="x", labelsize=9)
    ax.set_xlabel(f"time ({time_scale_name(unit)})", fontsize=9)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.margins(0)


def _shade(color: str, chunk: int, v: int) -> tuple[float, float, float]:
    """Later virtual-stage chunks of a rank are drawn lighter (mixed with white)."""
    from matplotlib.colors import to_rgb

    r, g, b = to_rgb(color)
    mix = 0.0 if v <= 1 else 0.5 * chunk / (v - 1)
    return (r + (1 - r) * mix, g + (1 - g) * mix, b + (1 - b) * mix)


def _draw_boxes(ax: Any, events: list[Event], timeline: Timeline, v: int, px_per_unit: float) -> list[str]:
    """One PolyCollection per kind; returns the legend entries drawn, in order."""
    import numpy as np
    from matplotlib.collections import PolyCollection

    chunks = chunk_index(timeline) if v > 1 else {}
    shades = {(k, c): _shade(COLORS[k], c, v) for k in COLORS for c in range(v)}
    groups: dict[str, list[tuple[float, float, int, tuple[float, float, float] | str]]] = {}
    min_px = 2.0 / px_per_unit  # thin bars stay visible
    for e in events:
        kind = e.action.kind
        if kind.is_compute:
            color: tuple[float, float, float] | str = shades[kind, chunks.get((e.rank, e.action.stage), 0)]
            groups.setdefault(kind.value, []).append((e.start, e.end, e.rank, color))
        elif kind in COLORS:
            groups.setdefault(kind.value, []).append((e.start, max(e.end, e.start + min_px), e.rank, COLORS[kind]))
        else:
            groups.setdefault("comm", []).append((e.start, max(e.end, e.start + min_px), e.rank, _COMM_COLOR))
    compute = [e.duration * px_per_unit for e in events if e.action.kind.is_compute]
    edge = 0.6 if compute and sorted(compute)[len(compute) // 2] >= 5 else 0.0
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
        verts = np.stack(
            [
                np.stack([x0, y - half], 1),
                np.stack([x0, y + half], 1),
                np.stack([x1, y + half], 1),
                np.stack([x1, y - half], 1),
            ],
            axis=1,
        )
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


def _draw_labels(ax: Any, events: list[Event], timeline: Timeline, v: int, px_per_unit: float, row_pt: float) -> None:
    """Micro-batch numbers (``s2:3`` with several stages per rank) in the boxes they fit in."""
    if row_pt < 7:
        return
    size = max(5.0, min(9.0, row_pt * 0.42))
    char_px = size * 0.62 * ax.figure.dpi / 72
    chunks = chunk_index(timeline) if v > 1 else {}
    named = timeline.meta.get("labels")  # e.g. {"1F3": "3v1"}: micro-batch and weight version (async schedules)
    if not isinstance(named, dict):
        named = {}
    for e in events:
        a = e.action
        if not a.kind.is_compute or a.microbatch is None:
            continue
        width = e.duration * px_per_unit
        label = named.get(str(a)) or (f"s{a.stage}:{a.microbatch}" if v > 1 else str(a.microbatch))
        if len(label) * char_px + 4 > width:
            label = str(a.microbatch)
            if len(label) * char_px + 3 > width:
                continue
        r, g, b = _shade(COLORS[a.kind], chunks.get((e.rank, a.stage), 0), v)
        dark = 0.299 * r + 0.587 * g + 0.114 * b < 0.55
        ax.text(
            (e.start + e.end) / 2,
            e.rank,
            label,
            ha="center",
            va="center",
            fontsize=size,
            color="white" if dark else "#1A1A1A",
            clip_on=True,
        )


def _title_and_legend(fig: Any, timeline: Timeline, title: str | None, v: int, drawn: list[str]) -> None:
    from matplotlib.patches import Patch

    span = timeline.makespan
    facts = [_plural(timeline.num_ranks, "rank")]
    m = timeline.meta.get("num_microbatches")
    if not isinstance(m, int):
        mbs = {e.action.microbatch for e in timeline.events if e.action.microbatch is not None}
        m = len(mbs) if mbs else None
    if m is not None:
        facts.append(_plural(m, "micro-batch", "micro-batches"))
    if v > 1:
        facts.append(f"{v} stages per rank")
    facts.append(f"bubble {timeline.bubble_ratio:.1%}")
    facts.append(f"makespan {span:.4g} {time_scale_name(timeline.unit)}")
    if timeline.source != "simulated":
        facts.append(timeline.source)
    height = fig.get_figheight()
    fig.text(0.5, 1 - 0.2 / height, title or timeline.name, ha="center", va="top", fontsize=13, weight="bold")
    fig.text(0.5, 1 - 0.48 / height, "  ·  ".join(facts), ha="center", va="top", fontsize=9.5, color="#333333")
    names = {k.value: KIND_NAMES[k] for k in KIND_NAMES}
    names["comm"] = "send/recv wait"
    colors = {k.value: COLORS[k] for k in COLORS}
    colors["comm"] = _COMM_COLOR
    handles = [Patch(facecolor=colors[k], label=names[k]) for k in drawn]
    if handles:
        fig.legend(
            handles=handles,
            loc="upper center",
            bbox_to_anchor=(0.5, 1 - 0.68 / height),
            ncol=len(handles),
            frameon=False,
            fontsize=9,
            handlelength=1.4,
            columnspacing=1.6,
        )


def _plural(count: int, one: str, many: str | None = None) -> str:
    return f"{count} {one if count == 1 else many or one + 's'}"
