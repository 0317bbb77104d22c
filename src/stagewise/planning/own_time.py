"""The seconds a rank spent on each compute action from the moment it could start (issue 49 item 3): pure, no torch.

What a slow rank is measured by (:func:`stagewise.planning.stragglers.rank_speeds`): a CPU quota stops a process
between its actions as often as inside them, so an action's own time runs from when its input was there, not from
when it started.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..ir import Event, Kind, Timeline
from .core_share import shared_seconds
from .link_fit import COMPUTE


def own_spans(
    timeline: Timeline, cores: float, latency: float = 0.0, nodes: Sequence[int] | None = None, local: float = 0.0
) -> list[tuple[Event, float]]:
    """Each compute event with the seconds its rank spent on it from the moment it could start: the latest of
    the step's start, the rank's previous compute action's end and its input's arrival, to its end; de-shared as
    :func:`~stagewise.planning.recalibrate.deshared` does (``n(t)`` the spans open at ``t`` on ``cores``).

    An input from another rank arrives ``latency`` after its producer's end or, when the timeline holds the
    producer's send, after that send was posted if later: a slowed rank posts its sends late (a CPU quota stops
    it between an action and the send after it: 7-9 ms gaps at 25 % of a core with a 10 ms period), and the
    peer waiting for them is not the slow one (read from the producer's end, the peer read slow too and, each
    speed relative to the fastest, the slowed rank looked 0.65x where it ran at 0.25x). With ``nodes`` (each
    rank's machine), an input from a rank of the same machine arrives ``local`` after instead: read at the
    network's latency, a slowed rank's stop after a loopback arrival was not counted as its own time."""
    compute = sorted((e for e in timeline.events if e.action.kind in COMPUTE), key=lambda e: (e.start, e.rank))
    if not compute:
        return []
    ends = {(e.action.kind, e.action.stage, e.action.microbatch): e for e in compute}
    sends: dict[tuple[Kind, int, int | None], float] = {
        (e.action.kind, e.action.stage, e.action.microbatch): e.start
        for e in timeline.events
        if e.action.kind in (Kind.SEND_F, Kind.SEND_B)
    }
    last = max(e.action.stage for e in compute)
    begin = min(e.start for e in timeline.events)
    previous: dict[int, float] = {}
    spans = []
    for e in compute:
        ready = max(begin, previous.get(e.rank, begin))
        source = _producer(e, last, ends)
        if source is not None and source.rank != e.rank:
            sent = sends.get((_SEND[source.action.kind], source.action.stage, source.action.microbatch), source.end)
            near = nodes is not None and nodes[source.rank] == nodes[e.rank]
            ready = max(ready, max(source.end, sent) + (local if near else latency))
        elif source is not None:
            ready = max(ready, source.end)
        spans.append((e, min(ready, e.start)))
        previous[e.rank] = max(previous.get(e.rank, begin), e.end)
    return list(zip((e for e, _ in spans), shared_seconds([(ready, e.end) for e, ready in spans], cores)))


#: the send that carries a compute action's output to another rank
_SEND = {Kind.F: Kind.SEND_F, Kind.B: Kind.SEND_B, Kind.I: Kind.SEND_B}


def _producer(e: Event, last: int, ends: dict[tuple[Kind, int, int | None], Event]) -> Event | None:
    """The compute event whose output ``e`` takes in: the previous stage's forward, the next stage's backward
    (or input-gradient), this stage's forward for the last stage's backward, its input-gradient for a W."""
    a = e.action
    if a.kind is Kind.F:
        return ends.get((Kind.F, a.stage - 1, a.microbatch)) if a.stage > 0 else None
    if a.kind is Kind.W:
        return ends.get((Kind.I, a.stage, a.microbatch))
    if a.stage < last:
        return ends.get((Kind.B, a.stage + 1, a.microbatch)) or ends.get((Kind.I, a.stage + 1, a.microbatch))
    return ends.get((Kind.F, a.stage, a.microbatch))
