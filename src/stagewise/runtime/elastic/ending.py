"""A clean exit's work for a rank's snapshots (:class:`Ending`), held apart from the pipeline that made it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import folder as folders

_ENDINGS: list[Ending] = []


@dataclass(eq=False)
class Ending:
    """What a clean exit needs of a rank's snapshots, held by this module until then: whether or not the
    pipeline is still alive at exit (a script's ``main()`` may have returned, and the garbage collector taken
    it), the job's end is marked and its snapshots on this machine removed. A failing rank leaves through the
    exit hook, which skips this: the restart needs them."""

    folder: Path
    job: str
    snapshotter: Any  # a weak reference: the in-flight snapshot, if the pipeline is still alive
    step: int = 0
    committed: int = 0  # the newest step held on two machines (outlives the pipeline: a benchmark reads it after)

    def release_at_exit(self) -> None:
        live = self.snapshotter()
        if live is not None:
            live.finish_at_exit()
        folders.mark_ended(self.folder, self.job, self.step)
        folders.prune(self.folder, self.step + 1)
        folders.remove_spares(self.folder)
