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

from . import storage
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
    """
    part = virtual_worker(model, path)
    if part is not None:  # a HetPipe: every virtual worker looks under its own folder, alike (they saved alike)
        folder, pipe, _ = part
        if _newest(folder, _ranks(pipe, collective, timeout))[0] is None:
            return None
        return load(path, model, optimizer, scheduler=scheduler, timeout=timeout)
    chosen, why = _newest(Path(path), _ranks(model, collective, timeout))
    if chosen is None:
        return None
    info = load(chosen, model, optimizer, scheduler=scheduler, collective=collective, timeout=timeout)
    return replace(info, reason=why)


def _newest(root: Path, ranks: storage.Ranks) -> tuple[Path | None, str]:
    """Rank 0's choice under ``root`` (see :func:`.retention.choose`), the same on every rank; logged."""
    try:
        chosen, why = agreed_newest(root, ranks, f"which checkpoint under {root} to resume from")
    finally:
        ranks.close()
    if ranks.first:
        log.info("stagewise.checkpoint.resume: %s", f"starting afresh: {why}" if chosen is None else f"{chosen}: {why}")
    return chosen, why
