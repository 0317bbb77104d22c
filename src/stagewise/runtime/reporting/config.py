"""``metrics=`` and ``progress=``: where a pipeline's per-step metrics go, and how often rank 0 logs a line.

``metrics="runs/exp1"`` (or a :class:`MetricsConfig`) writes each process's series under that folder: always a
JSON-lines file ``rank{R}.jsonl``, and TensorBoard event files under ``rank{R}/`` when the ``tensorboard``
package is installed (``pip install stagewise[tensorboard]``). ``stagewise run --metrics DIR`` sets it for every
pipeline of the script that does not set it itself (the environment variable :data:`METRICS_ENV`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Union

#: set by ``stagewise run --metrics DIR``: the folder of every pipeline that gives no ``metrics=``
METRICS_ENV = "STAGEWISE_METRICS"


@dataclass(frozen=True)
class MetricsConfig:
    """Where the per-step metrics go: ``dir`` (one JSON-lines file and one TensorBoard run per process);
    ``tensorboard=False`` writes the JSON lines only; ``every``: a record every N train steps (1: each)."""

    dir: str | os.PathLike[str]
    tensorboard: bool = True
    every: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.dir, (str, os.PathLike)) or not str(self.dir):
            raise TypeError(f"metrics: dir must be a folder (a str or a path), got {self.dir!r}")
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ValueError(
                f"metrics: every must be an integer >= 1 (train steps between records), got {self.every!r}"
            )
        if not isinstance(self.tensorboard, bool):
            raise TypeError(f"metrics: tensorboard must be True or False, got {self.tensorboard!r}")

    @property
    def path(self) -> Path:
        return Path(self.dir)


MetricsSpec = Union[str, "os.PathLike[str]", MetricsConfig, None]


def metrics_config(spec: MetricsSpec, environ: dict[str, str] | None = None) -> MetricsConfig | None:
    """``metrics=`` as a config: a folder or a :class:`MetricsConfig`; None: ``$STAGEWISE_METRICS`` if set, else
    no metrics (an empty variable is none too)."""
    if spec is None:
        folder = (os.environ if environ is None else environ).get(METRICS_ENV, "")
        return MetricsConfig(folder) if folder else None
    if isinstance(spec, MetricsConfig):
        return spec
    if isinstance(spec, (str, os.PathLike)):
        return MetricsConfig(spec)
    raise TypeError(f"metrics must be a folder (str or path), a stagewise.runtime.MetricsConfig or None, got {spec!r}")


def progress_every(progress: bool | int) -> int:
    """``progress=``: True (a line each step), an integer N (each N-th step) or False / 0 (none); 0 means none."""
    if isinstance(progress, bool):
        return int(progress)
    if not isinstance(progress, int) or progress < 0:
        raise ValueError(f"progress must be True, False or a number of steps >= 0 between lines, got {progress!r}")
    return progress
