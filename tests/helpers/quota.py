"""A step as a CPU quota makes it (cgroup ``cpu.cfs_quota_us``), for the straggler tests without processes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from stagewise.ir import Timeline
from stagewise.planning.link_fit import COMPUTE


def quota(timeline: Timeline, inside: Sequence[float], speeds: Sequence[float]) -> Timeline:
    """``timeline`` (run at ``speeds``) as a quota makes it: each rank's compute actions run at ``inside`` (faster
    than its speed) and the rest of its time is lost before each starts (the quota stopping the rank in a send, a
    receive already satisfied or between actions); every end stays, so the step and its order are the same."""
    events = []
    for e in timeline.events:
        r = e.rank
        if e.action.kind in COMPUTE and inside[r] > speeds[r]:
            e = replace(e, start=e.end - (e.end - e.start) * speeds[r] / inside[r])
        events.append(e)
    return replace(timeline, events=events)
