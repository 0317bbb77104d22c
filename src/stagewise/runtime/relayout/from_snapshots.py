"""When ``pipe.relayout`` takes a tensor from a snapshot file rather than a live owner (``live=``).

Every process of the world takes part in a re-layout, so every tensor has a live owner; a caller may still say
which processes' live tensors are sources (``live=``: a process about to be taken away, a machine it does not
trust). A tensor none of them holds then comes from the pipeline's own snapshot files (``snapshot=``), and only
from those of the current step, so that the state laid out is one state: every process with a part of the old
layout must have captured a snapshot at the step it stands at, written and copied (its helper waited for); else
the call is refused alike, naming the process and its last snapshot's step. The files are listed by the first
process of each machine, as a take-over lists them (:mod:`.snapfiles`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..checkpoint.declared import PipelineState, Progress
from ..checkpoint.newest import LIVE, Report, newest
from ..comm.machine import agent_number
from .snapfiles import Files, listed


def snapshot_refusals(old: PipelineState | None, live: Sequence[int] | None, world: int) -> list[str]:
    """Why this process cannot lay out from the snapshots (``live`` given): no snapshots, or none of the step
    it stands at. A bad ``live`` is refused too (every process sees the same)."""
    if live is None:
        return []
    bad = [r for r in live if not 0 <= r < world]
    out = [f"live= names ranks {bad} outside the world of {world} processes"] if bad else []
    if old is None:
        return out
    snap = old.snapshots
    if snap is None:
        return out + ["live= leaves tensors to the snapshot files, but the pipeline takes none (snapshot= off)"]
    snap.wait()  # the last capture written here and copied to the peer
    if snap.step not in snap.marks:
        last = max(snap.marks, default=None)
        out.append(
            f"live= leaves tensors to the snapshot files of the current step {snap.step}, but this process's last "
            f"snapshot is of step {last}: train to a snapshot step (snapshot=every) or keep every process live"
        )
    return out


def current_files(old: PipelineState | None, rank: int) -> Any:
    """This process's part of the file source: the current step's files of its machine, listed by the first
    process of the machine (a process without snapshots lists none)."""
    snap = None if old is None else old.snapshots
    if snap is None:
        return Files(agent_number())
    machine = snap.machines[snap.rank]
    first = snap.machines.index(machine) == snap.rank
    files = listed(snap.folder, machine, rank, (snap.step, snap.lineage)) if first else []
    return Files(machine, files)


def chosen_progress(everyone: Sequence[dict[str, Any]]) -> tuple[Progress, Any]:
    """The progress and LR schedule a re-layout restores: the chosen source's report (:mod:`..checkpoint.newest`:
    the live processes together hold the whole state of the current step; the lowest one reports it), after
    checking that every process holding a part reports the same (else refused alike, naming them)."""
    reports = [
        Report(LIVE, e["progress"]["train_steps"], holder=r, progress=(e["progress"], e["scheduler"]))
        for r, e in enumerate(everyone)
        if e["progress"] is not None
    ]
    chosen = newest(reports)
    if chosen is None:
        raise ValueError("relayout: no process holds a part of the pipeline: there is no state to lay out")
    told = {r.holder: r.progress[0] for r in reports}
    if any(p != chosen.report.progress[0] for p in told.values()):
        raise ValueError(f"relayout: the processes holding the pipeline report different progress: {told}")
    progress, schedule = chosen.report.progress
    return Progress(**progress), schedule
