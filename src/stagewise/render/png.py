"""Gantt charts of timelines as PNG images, in the style of the GPipe / PipeDream figures.

One figure is a header (title, facts, legend) over panels (:mod:`.gantt`): a
timeline whose boxes would be too thin to read is cut into strips of time,
one under the other; several timelines are stacked on one time scale, so a
measured step and its simulation line up box for box.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..ir import Kind, Timeline
from .gantt import COLORS, COMM_COLOR, Panel, draw_panel, drawn_events, shade
from .labels import DRAWN_KINDS, KIND_NAMES, stages_per_rank, time_scale_name

if TYPE_CHECKING:
    from matplotlib.figure import Figure

_FIG_WIDTH = 14.0  # inches
_LEFT, _RIGHT = 0.85, 0.25  # margins, inches
_MIN_BOX_PX = 18.0  # a box this wide holds a two-digit micro-batch; a chart of thinner boxes is cut into strips
_MAX_STRIPS = 8
_MAX_ROWS = 48  # strips stop when ranks x strips would pass this
_LEGEND_COLUMNS = 8


@dataclass
class _Part:
    panel: Panel
    title: str | None
    x_label: bool


def render_png(
    timeline: Timeline, path: str | Path, *, title: str | None = None, dpi: int = 110, strips: int | None = None
) -> Path:
    """Draw ``timeline`` as a Gantt chart (one row per rank, rank 0 on top) and save it as PNG.

    Boxes are coloured by kind (F, B, I, W; SYNC and STEP as thin bars; a
    zero-length action is not drawn, nor named in the legend) and carry their
    micro-batch; when ranks hold several stages, the stage is written under it
    (``s2``) and a rank's later stages are drawn lighter, which the legend
    says. A step whose boxes would be thinner than a two-digit label is cut
    into ``strips`` windows of time drawn one under the other (chosen when
    None; 1 never cuts). The header gives the schedule, the bubble share and
    the makespan, in the timeline's unit (seconds, or the simulator's cost units).
    """
    return _save(timeline_figure(timeline, title=title, dpi=dpi, strips=strips), path, dpi)


def render_stack(
    timelines: Sequence[Timeline],
    path: str | Path,
    *,
    titles: Sequence[str] | None = None,
    title: str | None = None,
    dpi: int = 110,
    share_x: bool = True,
) -> Path:
    """Draw several timelines one above the other in one PNG, e.g. a measured step over its simulation.

    With ``share_x`` (the default) every panel spans the longest makespan, each
    from its own first event, so equal durations are equal widths; the
    timelines must then share a unit (a measured run is in seconds: simulate
    with costs in seconds and set the simulated timeline's ``unit="s"``).
    ``share_x=False`` gives each panel its own scale (schedules of different
    lengths side by side). ``titles`` name the panels (default: each timeline's name).
    """
    fig = stack_figure(timelines, titles=titles, title=title, dpi=dpi, share_x=share_x)
    return _save(fig, path, dpi)


def timeline_figure(
    timeline: Timeline, *, title: str | None = None, dpi: int = 110, strips: int | None = None
) -> Figure:
    """The matplotlib figure :func:`render_png` saves (to save as SVG or PDF, or to inspect)."""
    width_px = (_FIG_WIDTH - _LEFT - _RIGHT) * dpi
    row_pt = _row_inches(timeline.num_ranks) * 72
    t0, span = _extent(timeline)
    k = _strip_count(timeline, width_px, span) if strips is None else strips
    if k < 1:
        raise ValueError(f"render_png: strips must be >= 1, got {k}")
    seg = span / k
    parts = [_Part(Panel(timeline, t0 + i * seg, seg, width_px, row_pt), None, i == k - 1) for i in range(k)]
    header = [(title or timeline.name, 13.0, "bold"), ("  ·  ".join(_facts(timeline)), 9.5, "normal")]
    return _figure(header, parts, dpi)


def stack_figure(
    timelines: Sequence[Timeline],
    *,
    titles: Sequence[str] | None = None,
    title: str | None = None,
    dpi: int = 110,
    share_x: bool = True,
) -> Figure:
    """The matplotlib figure :func:`render_stack` saves."""
    if not timelines:
        raise ValueError("render_stack: no timelines to draw")
    if titles is not None and len(titles) != len(timelines):
        raise ValueError(f"render_stack: {len(titles)} titles for {len(timelines)} timelines")
    units = sorted({t.unit for t in timelines})
    if share_x and len(units) > 1:
        raise ValueError(
            f"render_stack: one time scale for timelines of units {' and '.join(map(repr, units))}; "
            "give them one unit (a simulation from costs in seconds: dataclasses.replace(timeline, unit='s')) "
            "or pass share_x=False"
        )
    width_px = (_FIG_WIDTH - _LEFT - _RIGHT) * dpi
    longest = max(_extent(t)[1] for t in timelines)
    parts = []
    for i, timeline in enumerate(timelines):
        t0, span = _extent(timeline)
        name = titles[i] if titles is not None else timeline.name
        panel = Panel(timeline, t0, longest if share_x else span, width_px, _row_inches(timeline.num_ranks) * 72)
        last = i == len(timelines) - 1
        parts.append(_Part(panel, f"{name}  ·  " + "  ·  ".join(_facts(timeline)), last or not share_x))
    return _figure([(title, 13.0, "bold")] if title else [], parts, dpi)


def _save(fig: Figure, path: str | Path, dpi: int) -> Path:
    """Save as a PNG of at most 128 colours: flat boxes and text lose nothing seen, and the file a third of its size."""
    import io

    from PIL import Image

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi, facecolor="white")
    buffer.seek(0)
    with Image.open(buffer) as image:
        flat = image.convert("RGB").quantize(colors=128, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
    path = Path(path)
    flat.save(path, format="PNG", optimize=True)
    return path


def _row_inches(p: int) -> float:
    return 0.42 if p <= 16 else max(0.07, min(0.42, 13.0 / p))


def _extent(timeline: Timeline) -> tuple[float, float]:
    events = drawn_events(timeline)
    t0 = min((e.start for e in events), default=0.0)
    span = max((e.end for e in events), default=1.0) - t0
    return t0, span if span > 0 else 1.0


def _strip_count(timeline: Timeline, width_px: float, span: float) -> int:
    """Strips enough for three boxes in four (the lower quartile of compute boxes) to be :data:`_MIN_BOX_PX` wide,
    within the caps (1F1B's forwards are half its backwards: they count)."""
    widths = sorted(e.duration for e in drawn_events(timeline) if e.action.kind.is_compute)
    if not widths:
        return 1
    quartile_px = widths[len(widths) // 4] * width_px / span
    if quartile_px >= _MIN_BOX_PX:
        return 1
    return max(1, min(math.ceil(_MIN_BOX_PX / quartile_px), _MAX_STRIPS, _MAX_ROWS // max(timeline.num_ranks, 1)))


def _facts(timeline: Timeline) -> list[str]:
    facts = [_plural(timeline.num_ranks, "rank")]
    m = timeline.meta.get("num_microbatches")
    if not isinstance(m, int):
        mbs = {e.action.microbatch for e in timeline.events if e.action.microbatch is not None}
        m = len(mbs) if mbs else None
    if m is not None:
        facts.append(_plural(m, "micro-batch", "micro-batches"))
    v = stages_per_rank(timeline)
    if v > 1:
        facts.append(f"{v} stages per rank")
    facts.append(f"bubble {timeline.bubble_ratio:.1%}")
    facts.append(f"makespan {timeline.makespan:.4g} {time_scale_name(timeline.unit)}")
    if timeline.source != "simulated":
        facts.append(timeline.source)
    return facts


def _figure(header: list[tuple[str, float, str]], parts: list[_Part], dpi: int) -> Figure:
    """Lay out the header lines, the legend and the panels top to bottom, in inches, then draw them."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    drawn_v = max(stages_per_rank(part.panel.timeline) for part in parts)
    keys = _legend_keys(parts)
    legend_rows = max(1, math.ceil((len(keys) + (drawn_v if drawn_v > 1 else 0)) / _LEGEND_COLUMNS))
    header_h = 0.15 + sum(0.3 if size > 10 else 0.26 for _, size, _ in header) + 0.26 * legend_rows + 0.1
    heights = [_part_height(part) for part in parts]
    height = header_h + sum(heights)
    fig = Figure(figsize=(_FIG_WIDTH, height), dpi=dpi)
    FigureCanvasAgg(fig)
    y = 0.15  # inches from the top
    for text, size, weight in header:
        color = "#1A1A1A" if weight == "bold" else "#333333"
        fig.text(0.5, 1 - y / height, text, ha="center", va="top", fontsize=size, weight=weight, color=color)
        y += 0.3 if size > 10 else 0.26
    drawn: list[str] = []
    top = header_h
    for part, h in zip(parts, heights):
        if part.title:
            fig.text(_LEFT / _FIG_WIDTH, 1 - (top + 0.08) / height, part.title, ha="left", va="top", fontsize=10)
        rows_h = part.panel.row_pt / 72 * max(part.panel.timeline.num_ranks, 1)
        axes_top = top + (0.32 if part.title else 0.0)
        box = (_LEFT / _FIG_WIDTH, 1 - (axes_top + rows_h) / height, 1 - (_LEFT + _RIGHT) / _FIG_WIDTH, rows_h / height)
        drawn += draw_panel(fig.add_axes(box), part.panel, x_label=part.x_label)
        top += h
    _legend(fig, [k for k in keys if k in drawn], drawn_v, 1 - (y + 0.02) / height)
    return fig


def _part_height(part: _Part) -> float:
    rows_h = part.panel.row_pt / 72 * max(part.panel.timeline.num_ranks, 1)
    return (0.32 if part.title else 0.0) + rows_h + 0.28 + (0.22 if part.x_label else 0.0) + 0.12


def _legend_keys(parts: list[_Part]) -> list[str]:
    """The legend keys with something drawn, in legend order: compute kinds of positive length, SYNC, ..."""
    present = set()
    for part in parts:
        for e in drawn_events(part.panel.timeline):
            kind = e.action.kind
            present.add(kind.value if kind in COLORS else "comm")
    return [k for k in [k.value for k in DRAWN_KINDS] + ["comm"] if k in present]


def _legend(fig: Any, keys: list[str], v: int, y: float) -> None:
    """Kinds drawn, then, with several stages per rank, one entry per shade (a swatch of each kind's colour)."""
    from matplotlib.patches import Patch

    names = {k.value: KIND_NAMES[k] for k in KIND_NAMES} | {"comm": "send/recv wait"}
    colors = {k.value: COLORS[k] for k in COLORS} | {"comm": COMM_COLOR}
    handles: list[Any] = [Patch(facecolor=colors[k], label=names[k]) for k in keys]
    if v > 1:
        kinds = [k for k in COLORS if k.is_compute and k.value in keys] or [Kind.F]
        for chunk in range(v):
            handle = _ShadeSwatch([shade(COLORS[k], chunk, v) for k in kinds])
            handle.set_label(_chunk_name(chunk, v))
            handles.append(handle)
    if handles:
        fig.legend(
            handles=handles,
            handler_map={_ShadeSwatch: _ShadeHandler()},
            loc="upper center",
            bbox_to_anchor=(0.5, y),
            ncol=math.ceil(len(handles) / math.ceil(len(handles) / _LEGEND_COLUMNS)),  # rows of even length
            frameon=False,
            fontsize=9,
            handlelength=1.4 if v <= 1 else 2.4,
            columnspacing=1.6,
        )


def _chunk_name(chunk: int, v: int) -> str:
    """What the shade of a rank's ``chunk``-th stage means, e.g. ``2nd stage on a rank (lighter)``."""
    nth = {0: "1st", 1: "2nd", 2: "3rd"}.get(chunk, f"{chunk + 1}th")
    return f"{nth} stage on a rank" + (" (lighter)" if chunk else "")


class _ShadeSwatch:
    """A legend handle: the compute kinds' colours at one virtual-stage shade."""

    def __init__(self, colors: list[tuple[float, float, float]]) -> None:
        self.colors = colors
        self._label = ""

    def set_label(self, label: str) -> None:
        self._label = label

    def get_label(self) -> str:
        return self._label


class _ShadeHandler:
    """Draws a :class:`_ShadeSwatch` as small squares side by side, one per colour."""

    def legend_artist(self, legend: Any, orig_handle: _ShadeSwatch, fontsize: float, handlebox: Any) -> Any:
        from matplotlib.patches import Rectangle

        n = len(orig_handle.colors)
        w, h = handlebox.width / n, handlebox.height
        squares = [
            Rectangle((handlebox.xdescent + i * w, handlebox.ydescent), w, h, facecolor=c, edgecolor="white", lw=0.5)
            for i, c in enumerate(orig_handle.colors)
        ]
        for square in squares:
            handlebox.add_artist(square)
        return squares[0]


def _plural(count: int, one: str, many: str | None = None) -> str:
    return f"{count} {one if count == 1 else many or one + 's'}"
