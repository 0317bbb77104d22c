"""A step as a CPU quota makes it (cgroup ``cpu.cfs_quota_us``), for the straggler tests without processes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from stagewise.ir import Action, Event, Kind, Timeline
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


def late_sends(timeline: Timeline, inside: Sequence[float], speeds: Sequence[float], last: int) -> Timeline:
    """``timeline`` (run at ``speeds``, stages ``0..last`` on their ranks) as a quota that stops a rank after its
    actions makes it: each compute action runs at ``inside`` and ends early, the rest of its time lost between
    it and the send of its output, posted when the action ended in ``timeline``; every rank's sends are added
    (a forward's output goes on unless its stage is the last, a backward's unless its stage is the first)."""
    events = []
    for e in timeline.events:
        r, a = e.rank, e.action
        if a.kind in COMPUTE:
            posted = e.end
            if inside[r] > speeds[r]:
                e = replace(e, end=e.start + (e.end - e.start) * speeds[r] / inside[r])
            send = {Kind.F: Kind.SEND_F, Kind.B: Kind.SEND_B}.get(a.kind)
            if send is not None and (a.stage < last if a.kind is Kind.F else a.stage > 0):
                events.append(Event(r, Action(a.stage, send, a.microbatch), posted, posted))
        events.append(e)
    return replace(timeline, events=events)
