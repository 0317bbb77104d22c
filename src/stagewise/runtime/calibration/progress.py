"""Progress of the long measurements (``calibrate()``, ``measure_compute_scale()``), drawn on global rank 0.

Each runs for one to a few minutes (``calibrate()`` at 8 processes on 2 cores: about 90 s) with nothing else to
show; a bar naming the probe it is in says that it has not hung. Every rank runs the same probes in the same
order, so rank 0 alone draws (on stderr, with rich); the other ranks, ``show=False`` and a process without
torch.distributed get a :class:`Steps` that draws nothing.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any

from ..comm.groups import global_rank


class Steps:
    """A bar of ``total`` steps titled ``title``: :meth:`next` names the step starting (the one before is done).

    Use it as a context manager: the bar stops (and stays on the screen) when the block ends.
    """

    def __init__(self, title: str, total: int, show: bool = True) -> None:
        self.title, self.total = title, max(total, 1)
        self._bar: Any = None
        self._task: Any = None
        self._started = False
        if show and _first_rank():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._bar = Progress(
                TextColumn("[bold]{task.fields[title]}[/]"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("{task.description}"),
                console=Console(stderr=True),
            )

    def __enter__(self) -> Steps:
        if self._bar is not None:
            self._bar.start()
            self._task = self._bar.add_task("", total=self.total, title=self.title)
        return self

    def next(self, doing: str) -> None:
        """The previous step is done; ``doing`` starts."""
        if self._bar is None:
            return
        self._bar.update(self._task, advance=1 if self._started else 0, description=doing)
        self._started = True

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None) -> None:
        if self._bar is None:
            return
        if kind is None:
            self._bar.update(self._task, completed=self.total, description="done")
        self._bar.stop()


def _first_rank() -> bool:
    try:
        return global_rank() == 0
    except Exception:  # torch.distributed not initialised: the caller's own check says so
        return False
