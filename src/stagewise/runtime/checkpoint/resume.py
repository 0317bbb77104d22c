"""``resume``: load the newest complete checkpoint if there is one, the same call on a fresh start and a restart.

A job under ``stagewise run --max-restarts N`` is started again from the top
after a rank dies; its script calls ``resume`` once, before training, and
continues from ``info.step`` (or from 0 when it returns None). Rank 0 looks
for the checkpoint and tells the others, so every rank takes the same branch
even while a stale ``.step-N.tmp`` of the killed attempt is still on disk.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from torch import nn

from . import state, storage
from .api import CheckpointInfo, _ranks, agreed_newest, load, virtual_worker

log = logging.getLogger(__name__)


def resume(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: Any = None,
    *,
    scheduler: Any = None,
    collective: bool = True,
    timeout: float = 600.0,
) -> CheckpointInfo | None:
    """Load the newest checkpoint under ``path`` into ``model`` (see :func:`load`); None if there is none.

    A collective, like :func:`load`: every rank gets None, or every rank loads
    the same folder. A checkpoint that is there but damaged raises
    :class:`CheckpointError` rather than silently starting afresh - and so does
    a newest ``step-N`` that lost its manifest, rather than silently resuming
    from an older one (:func:`.retention.choose`). What it loads, and why, is
    logged and in ``info.reason``.

        info = sw.checkpoint.resume("ckpt", pipe)
        start = 0 if info is None else info.step

    A pipeline built with ``snapshot=`` also weighs the snapshots in its machines' memory and takes the newer
    (:mod:`stagewise.runtime.elastic.recover`); a resume logs one line on rank 0 saying from where, at which
    step, and on how many processes (``resumed step 10 on 4 processes (was 6): pp 2 x dp 2 (was pp 2 x dp 3),
    from peer snapshots``).
    """
    snapshots = getattr(model, "snapshots", None)
    if snapshots is not None:  # Pipeline(snapshot=...): the peers' snapshots too (stagewise.runtime.elastic)
        options = {"optimizer": optimizer, "scheduler": scheduler, "collective": collective, "timeout": timeout}
        return snapshots.resume(path, model, **options)
    part = virtual_worker(model, path)
    if part is not None:  # a HetPipe: every virtual worker looks under its own folder, alike (they saved alike)
        folder, pipe, _ = part
        if _newest(folder, _ranks(pipe, collective, timeout))[0] is None:
            return None
        return load(path, model, optimizer, scheduler=scheduler, timeout=timeout)
    ranks = _ranks(model, collective, timeout)
    chosen, why = _newest(Path(path), ranks)
    if chosen is None:
        return None
    info = load(chosen, model, optimizer, scheduler=scheduler, collective=collective, timeout=timeout)
    if ranks.first and state.is_pipeline(model):
        now = state.layout_of(model, ranks.size)
        line = resumed_line(info.step, now, info.layout, f"from checkpoint {chosen}")
        log.warning("stagewise: %s%s", line, scheduler_note(info))
    return replace(info, reason=why)


def resumed_line(step: int, now: dict[str, Any], was: dict[str, Any], source: str) -> str:
    """``resumed step 1200 on 4 processes (was 8): pp 2 x dp 2 (was pp 2 x dp 4), from peer snapshots``; the
    ``(was ...)`` parts only where they differ. ``now`` / ``was``: layouts as :func:`.state.layout_of` writes them."""
    world, before = now.get("world"), was.get("world")
    line = f"resumed step {step} on {world} processes" + (f" (was {before})" if before != world else "")
    mesh, old = _mesh(now), _mesh(was)
    return f"{line}: {mesh}" + (f" (was {old})" if old != mesh else "") + f", {source}"


def _mesh(layout: dict[str, Any]) -> str:
    """``pp 2 x dp 2`` (the degrees above 1; pp always), or ``one process`` for a plain module's checkpoint."""
    parallel, pipeline = layout.get("parallel"), layout.get("pipeline")
    if parallel:
        named = [(a, parallel[a]) for a in ("pp", "dp", "sharding", "tp") if parallel[a] > 1 or a == "pp"]
        return " x ".join(f"{a} {n}" for a, n in named)
    return f"pp {pipeline['ranks']}" if pipeline else "one process"


def scheduler_note(info: CheckpointInfo) -> str:
    """What the resumed line adds when the checkpoint's LR scheduler state went nowhere (the warm-up restarts)."""
    if not info.scheduler_saved or info.scheduler_restored:
        return ""
    return (
        "; its LR scheduler state was NOT restored (none given): pass scheduler= to resume, or build the "
        "Pipeline with lr_scheduler=, else the schedule starts over"
    )


def step_of(folder: Path) -> int:
    """The step of a ``step-N`` checkpoint folder (its manifest's record says the same)."""
    return int(folder.name.removeprefix("step-"))


def _newest(root: Path, ranks: storage.Ranks) -> tuple[Path | None, str]:
    """Rank 0's choice under ``root`` (see :func:`.retention.choose`), the same on every rank; logged. (Closes
    ``ranks``' own guard: the load that follows makes its own.)"""
    try:
        chosen, why = agreed_newest(root, ranks, f"which checkpoint under {root} to resume from")
    finally:
        ranks.close()
    if ranks.first:
        log.info("stagewise.checkpoint.resume: %s", f"starting afresh: {why}" if chosen is None else f"{chosen}: {why}")
    return chosen, why
