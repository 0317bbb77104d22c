"""``--pays``' pictures: each schedule's measured step over its simulation, every panel on one time axis.

The measured panel is the timed step whose time is the median's (every rank's timeline, gathered); the
simulated one is the simulator's timeline from the profile's costs and the calibrated link, in seconds.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import stagewise as sw

from .breakdown import step_times


def median_step(sched: Mapping[str, Any]) -> sw.Timeline:
    """The gathered timeline of the timed step nearest the median step time."""
    times = step_times(sched["records"])
    middle = statistics.median(times)
    k = min(range(len(times)), key=lambda i: abs(times[i] - middle))
    return sw.Timeline.from_json(sched["timelines"][k])


def draw(jobs: Sequence[Mapping[str, Any]], out: Path) -> list[Path]:
    """One PNG per job: measured over simulated, schedule by schedule, on one time axis."""
    drawn = []
    for job in jobs:
        timelines, titles = [], []
        for label, sched in job["schedules"].items():
            if not sched.get("timelines"):
                continue
            measured = median_step(sched)
            simulated = sw.Timeline.from_json(sched["predicted"]["timeline"])
            timelines += [measured, simulated]
            titles += [f"{label}: measured (median step)", f"{label}: simulated (profile + link)"]
        if timelines:
            target = out / f"timelines-{job['workload']}-{job['ranks']}.png"
            title = f"{job['title']}, {job['ranks']} ranks, {job['microbatches']} micro-batches"
            drawn.append(sw.render.render_stack(timelines, target, titles=titles, title=title, dpi=80))
    return drawn
