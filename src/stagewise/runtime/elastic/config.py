"""``snapshot=``: each rank's training state after every k-th step, in memory on its machine and on a peer's.

``Pipeline(..., optimizer=factory, snapshot=k)`` (or ``snapshot=sw.Snapshots(every=k, ...)``) keeps, after
every k-th ``train_step``, what a restart needs - the parameters and buffers, the pipeline's optimizers'
state, every generator's state, the step and the data position - in a file on this machine's memory file
system (``/dev/shm``) and in one on the next machine's, so a machine lost for good costs at most k steps
(:mod:`.snapshots`); ``sw.checkpoint.resume`` weighs them against the newest checkpoint on disk
(:mod:`.recover`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..._util import is_count

#: where the snapshots live on each machine when ``folder`` is not given (a machine may say otherwise)
FOLDER_ENV = "STAGEWISE_SNAPSHOT_DIR"
DEFAULT_FOLDER = "/dev/shm"

#: ``Snapshots.commit``: a step committed one step behind ``train_step``, or before it returns
COMMITS = ("pipelined", "sync")


@dataclass(frozen=True)
class Snapshots:
    """``snapshot=``: keep each rank's training state after every ``every``-th train step, on two machines.

    ``folder``: where on each machine (default ``$STAGEWISE_SNAPSHOT_DIR``, else ``/dev/shm``: memory that
    outlives a worker's restart, not the machine). ``extra``: called at each snapshot on every rank; its
    JSON-like result (the data position: a sampler's state, an epoch) comes back as ``info.extra`` on
    resume. A step counter is kept by the pipeline: the ``n``-th ``train_step`` after a resume from step
    ``s`` is step ``s + n``.

    ``commit``: when a step counts as *committed* (``Pipeline.committed_step``: held on two machines).
    ``"pipelined"`` (the default): ``train_step`` waits at its end for the previous step's commit, so a step
    that returned may be trained again after a loss (at most one such step). ``"sync"``: a ``train_step`` that
    takes a snapshot returns only once its step is committed (with ``every=1`` no step that returned is trained
    again after a loss); the whole snapshot is then on that step's path (what each costs:
    docs/benchmarks/recovery.md).
    """

    every: int = 1
    folder: str | None = None
    extra: Callable[[], Any] | None = None
    commit: str = "pipelined"

    def __post_init__(self) -> None:
        if not is_count(self.every):
            raise ValueError(f"Snapshots.every must be an integer >= 1 (steps between snapshots), got {self.every!r}")
        if self.folder is not None and not isinstance(self.folder, (str, os.PathLike)):
            raise TypeError(f"Snapshots.folder must be a path, got {self.folder!r}")
        if self.commit not in COMMITS:
            raise ValueError(f"Snapshots.commit must be one of {', '.join(map(repr, COMMITS))}, got {self.commit!r}")
        if self.extra is not None and not callable(self.extra):
            raise TypeError(f"Snapshots.extra must be a function () -> JSON-like data position, got {self.extra!r}")

    def root(self) -> Path:
        """This machine's folder for the snapshots (``folder``, else the environment's, else ``/dev/shm``)."""
        return Path(self.folder or os.environ.get(FOLDER_ENV) or DEFAULT_FOLDER)


SnapshotSpec = int | Snapshots | None


def snapshot_config(value: SnapshotSpec) -> Snapshots | None:
    """``snapshot=`` as a :class:`Snapshots` (an int ``k`` is ``Snapshots(every=k)``), or None; refused by name."""
    if value is None or isinstance(value, Snapshots):
        return value
    if is_count(value):
        return Snapshots(every=int(value))
    raise ValueError(f"snapshot must be a number of steps >= 1, a stagewise.Snapshots or None, got {value!r}")
