"""Renderers: draw a :class:`~stagewise.ir.timeline.Timeline` (simulated or measured) as PNG, trace or text.

* :func:`render_png` — Gantt chart, one row per rank (matplotlib, imported on call); a long step is cut
  into strips of time so that its boxes stay readable;
* :func:`render_stack` — several timelines one above the other on one time scale (a measured step over
  its simulation); :func:`timeline_figure` and :func:`stack_figure` give the matplotlib figures;
* :func:`render_trace` — Chrome / Perfetto trace JSON (open in ui.perfetto.dev;
  :func:`trace_events` gives the same as a dict);
* :func:`render_ascii` — a text chart for terminals and docstrings.
"""

from __future__ import annotations

from .ascii import render_ascii
from .png import render_png, render_stack, stack_figure, timeline_figure
from .trace import render_trace, trace_events

__all__ = [
    "render_ascii",
    "render_png",
    "render_stack",
    "render_trace",
    "stack_figure",
    "timeline_figure",
    "trace_events",
]
