"""What a step leaves behind for the user: its measured timeline and its losses, gathered over the ranks."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ...ir import Event, Timeline, parse_action
from ..comm import collectives
from .timings import ActionEvent


def step_timeline(
    events: Sequence[ActionEvent],
    *,
    rank: int,
    num_ranks: int,
    name: str,
    meta: dict[str, object],
    started: float,
    clock_offset: float,
    group: Any = None,
    wait: collectives.Wait | None = None,
) -> Timeline:
    """This rank's ``events`` (perf_counter seconds) as a Timeline from ``started``; with ``group`` (a collective)
    every rank's, on one wall clock (``clock_offset`` = time.time() - time.perf_counter() on each rank), gathered as
    JSON within ``wait``'s deadline (the pipeline guard's: its timeout and error board)."""
    if group is None:
        local = [Event(rank, a, t0 - started, t1 - started) for a, t0, t1 in events]
        return Timeline(name, num_ranks, local, source="measured", unit="s", meta=meta)
    everyone = collectives.gather_json([rank, wall_rows(events, clock_offset)], group, wait, "every rank's timeline")
    return merged_timeline(everyone, num_ranks=num_ranks, name=name, meta=meta)


def step_meta(mode: str, ran: bool, num_microbatches: int) -> dict[str, object]:
    """A measured step's Timeline meta: its mode (None when no such step ran) and its micro-batches."""
    return {"mode": mode if ran else None, "num_microbatches": num_microbatches}


def wall_rows(events: Sequence[ActionEvent], clock_offset: float) -> list[list[Any]]:
    """This rank's ``events`` as JSON rows ``[action, start, end]`` on the wall clock (``clock_offset`` =
    time.time() - time.perf_counter() here), what crosses ranks to be merged (:func:`merged_timeline`)."""
    return [[str(a), t0 + clock_offset, t1 + clock_offset] for a, t0, t1 in events]


def merged_timeline(
    everyone: Sequence[Sequence[Any]], *, num_ranks: int, name: str, meta: dict[str, object]
) -> Timeline:
    """Every rank's ``[rank, wall_rows]`` as one Timeline, seconds from the earliest start."""
    starts = [t0 for _, rows in everyone for _, t0, _ in rows]
    base = min(starts) if starts else 0.0
    merged = [Event(r, parse_action(a), t0 - base, t1 - base) for r, rows in everyone for a, t0, t1 in rows]
    merged.sort(key=lambda e: (e.rank, e.start))
    return Timeline(name, num_ranks, merged, source="measured", unit="s", meta=meta)


def gathered_losses(
    loss: float, aux_local: dict[str, float], group: Any, wait: collectives.Wait | None = None
) -> dict[str, float]:
    """``{"loss": main, "aux": sum of aux terms, "aux/NAME": each}``, aux terms summed over the ranks (a collective,
    bounded by ``wait``'s deadline)."""
    everyone = collectives.gather_json(aux_local, group, wait, "every rank's aux losses")
    names = sorted({n for d in everyone for n in d})
    per = {n: sum(d.get(n, 0.0) for d in everyone) for n in names}
    out = {"loss": loss, "aux": sum(per.values())}
    out.update({f"aux/{n}": v for n, v in per.items()})
    return out


def version_report(versions: Mapping[int, Any] | None, schedule: str) -> dict[int, dict[str, int]]:
    """``Pipeline.version_report``: per local stage, the most weight snapshots held at once and their bytes."""
    if versions is None:
        raise ValueError(f"schedule {schedule!r} is synchronous: it keeps no weight versions")
    out = {}
    for s, v in sorted(versions.items()):
        size = sum(p.numel() * p.element_size() for p in v.stage.params)
        out[s] = {"peak_snapshots": v.peak, "peak_bytes": v.peak * size}
    return out
