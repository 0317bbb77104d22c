"""What every renderer writes on an event: kind, micro-batch and, with virtual stages, the stage."""

from __future__ import annotations

from ..ir import Event, Kind, Timeline

#: compute kinds and per-stage kinds, in legend order
DRAWN_KINDS = (Kind.F, Kind.B, Kind.I, Kind.W, Kind.SYNC, Kind.STEP)

KIND_NAMES = {
    Kind.F: "F forward",
    Kind.B: "B backward",
    Kind.I: "I input grad",
    Kind.W: "W weight grad",
    Kind.SYNC: "SYNC grad sync",
    Kind.STEP: "STEP optimizer",
}


def stages_per_rank(timeline: Timeline) -> int:
    """The most distinct stages any rank computes in ``timeline`` (v for interleaved / V schedules)."""
    seen: list[set[int]] = [set() for _ in range(timeline.num_ranks)]
    for e in timeline.events:
        if e.action.kind.is_compute and 0 <= e.rank < timeline.num_ranks:
            seen[e.rank].add(e.action.stage)
    return max((len(s) for s in seen), default=1) or 1


def chunk_index(timeline: Timeline) -> dict[tuple[int, int], int]:
    """(rank, stage) -> 0, 1, ... in the order of the rank's stages (its virtual-stage chunk)."""
    stages: dict[int, set[int]] = {}
    for e in timeline.events:
        stages.setdefault(e.rank, set()).add(e.action.stage)
    return {(rank, s): k for rank, ss in stages.items() for k, s in enumerate(sorted(ss))}


def short_label(e: Event, with_stage: bool) -> str:
    """``F3`` (kind and micro-batch), or ``2F3`` (the action's text form) when ranks hold several stages."""
    a = e.action
    if a.microbatch is None:
        return f"{a.stage}{a.kind.value}" if with_stage else a.kind.value
    return str(a) if with_stage else f"{a.kind.value}{a.microbatch}"


def time_scale_name(unit: str) -> str:
    return "cost units" if unit == "cost" else unit
