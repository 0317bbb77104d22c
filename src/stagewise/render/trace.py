"""Chrome / Perfetto trace JSON: one thread per rank, one complete ("X") event per action.

Open the file in https://ui.perfetto.dev or chrome://tracing. Trace times are
microseconds; a measured timeline (unit ``"s"``) keeps its real times, and a
simulated one (unit ``"cost"``) is drawn with **1 cost unit = 1 ms**.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..ir import Timeline
from .labels import short_label, stages_per_rank

#: microseconds per timeline unit; simulated cost units are shown as milliseconds
US_PER_UNIT = {"s": 1e6, "ms": 1e3, "us": 1.0, "ns": 1e-3, "cost": 1e3}


def trace_events(timeline: Timeline) -> dict[str, object]:
    """The trace as a JSON-ready dict (``{"traceEvents": [...], ...}``)."""
    try:
        scale = US_PER_UNIT[timeline.unit]
    except KeyError:
        units = ", ".join(repr(u) for u in US_PER_UNIT)
        raise ValueError(f"timeline {timeline.name!r} has unit {timeline.unit!r}; expected one of {units}") from None
    pid = 0
    meta: list[dict[str, object]] = [
        {"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"{timeline.name} ({timeline.source})"}},
    ]
    for rank in range(timeline.num_ranks):
        meta.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": rank, "args": {"name": f"rank {rank}"}})
        meta.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": rank, "args": {"sort_index": rank}})
    with_stage = stages_per_rank(timeline) > 1
    events: list[dict[str, object]] = []
    for e in sorted(timeline.events, key=lambda e: (e.rank, e.start, e.end)):
        a = e.action
        events.append(
            {
                "name": short_label(e, with_stage),
                "cat": a.kind.value,
                "ph": "X",
                "pid": pid,
                "tid": e.rank,
                "ts": e.start * scale,
                "dur": max(e.duration, 0.0) * scale,
                "args": {"action": str(a), "kind": a.kind.value, "stage": a.stage, "microbatch": a.microbatch},
            }
        )
    return {
        "traceEvents": meta + events,
        "displayTimeUnit": "ms",
        "otherData": {
            "schedule": timeline.name,
            "source": timeline.source,
            "unit": timeline.unit,
            "microseconds_per_unit": scale,
            "num_ranks": timeline.num_ranks,
        },
    }


def render_trace(timeline: Timeline, path: str | Path) -> Path:
    """Write ``timeline`` as a Chrome / Perfetto trace JSON file at ``path``; return the path."""
    path = Path(path)
    path.write_text(json.dumps(trace_events(timeline)))
    return path
