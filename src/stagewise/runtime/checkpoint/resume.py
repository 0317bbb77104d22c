"""``resume``: load the newest complete checkpoint if there is one, the same call on a fresh start and a restart.

A job under ``stagewise run --max-restarts N`` is started again from the top
after a rank dies; its script calls ``resume`` once, before training, and
continues from ``info.step`` (or from 0 when it returns None). Rank 0 looks
for the checkpoint and tells the others, so every rank takes the same branch
even while a stale ``.step-N.tmp`` of the killed attempt is still on disk.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from torch import nn

from . import retention, storage
from .api import CheckpointInfo, _ranks, load, virtual_worker


def resume(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: Any = None,
    *,
    scheduler: Any = None,
    collective: bool = True,
) -> CheckpointInfo | None:
    """Load the newest complete checkpoint under ``path`` into ``model`` (see :func:`load`); None if there is none.

    A collective, like :func:`load`: every rank gets None, or every rank loads
    the same folder. A checkpoint that is there but damaged raises
    :class:`CheckpointError` rather than silently starting afresh.

        info = sw.checkpoint.resume("ckpt", pipe)
        start = 0 if info is None else info.step
    """
    part = virtual_worker(model, path)
    if part is not None:  # a HetPipe: every virtual worker looks under its own folder, alike (they saved alike)
        folder, pipe, _ = part
        ranks = _ranks(pipe, collective)
        newest = retention.latest(folder) if ranks.first else None
        if storage.gather(None if newest is None else str(newest), ranks)[0] is None:
            return None
        return load(path, model, optimizer, scheduler=scheduler)
    ranks = _ranks(model, collective)
    newest = retention.latest(Path(path)) if ranks.first else None
    chosen = storage.gather(None if newest is None else str(newest), ranks)[0]
    if chosen is None:
        return None
    return load(chosen, model, optimizer, scheduler=scheduler, collective=collective)
