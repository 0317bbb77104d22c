"""Where a process's metrics are written: a JSON-lines file (always) and TensorBoard event files (when installed).

A sink that cannot write (a read-only folder, a full disk) says so in one log line and stops writing; training
goes on. The line names the file and the error::

    stagewise metrics: cannot write runs/exp1/rank0.jsonl ([Errno 28] No space left on device); training goes
    on without it
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger(__name__)
_JSON = json.JSONEncoder(default=str)  # (made once: json.dumps with options builds an encoder per call)


class Sink(Protocol):
    def scalars(self, step: int, values: dict[str, float]) -> None: ...
    def event(self, step: int, record: dict[str, Any]) -> None: ...
    def close(self) -> None: ...


class Failures:
    """The one line a process's metrics write when they cannot: the first failure is said, later ones are not
    (each failing sink stops writing)."""

    def __init__(self) -> None:
        self.said = False

    def __call__(self, path: Path, err: BaseException) -> None:
        if not self.said:
            self.said = True
            log.warning("stagewise metrics: cannot write %s (%s); training goes on without it", path, err)


class JsonLines:
    """One JSON object per line: ``{"step": N, "loss": ..., ...}`` per record, ``{"event": NAME, ...}`` per event."""

    def __init__(self, path: Path, fields: dict[str, Any], failed: Failures) -> None:
        self.path, self.failed = path, failed
        self.fields = fields  # written into every line (the process and pipeline rank)
        self.file: Any = None
        try:
            self.file = path.open("a", encoding="utf-8")
        except OSError as err:
            self.failed(path, err)

    def _write(self, record: dict[str, Any]) -> None:
        if self.file is None:
            return
        try:
            self.file.write(_JSON.encode({**record, **self.fields}) + "\n")
            self.file.flush()
        except OSError as err:
            self.failed(self.path, err)
            self._drop()

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self._write({"step": step, **values})

    def event(self, step: int, record: dict[str, Any]) -> None:
        self._write({"step": step, **record})

    def _drop(self) -> None:
        file, self.file = self.file, None
        try:
            file.close()
        except OSError:
            pass

    def close(self) -> None:
        if self.file is not None:
            self._drop()


class TensorBoard:
    """``torch.utils.tensorboard``'s writer: one scalar per value, an event as ``events/NAME`` (how many so far) and
    a text entry. Any failure of the writer (its folder, its disk, its thread) is one log line, then silence."""

    def __init__(self, folder: Path, failed: Failures) -> None:
        self.folder, self.failed = folder, failed
        self.writer: Any = None
        self.counts: dict[str, int] = {}
        from torch.utils.tensorboard import SummaryWriter  # (the caller checked that tensorboard is installed)

        try:
            self.writer = SummaryWriter(str(folder), flush_secs=10)
        except Exception as err:  # noqa: BLE001 (third-party writer: whatever it raises, training goes on)
            self.failed(folder, err)

    def _call(self, body: Any) -> None:
        if self.writer is None:
            return
        try:
            body(self.writer)
        except Exception as err:  # noqa: BLE001 (as above)
            self.failed(self.folder, err)
            writer, self.writer = self.writer, None
            try:
                writer.close()
            except Exception:  # noqa: BLE001, S110 (already reported)
                pass

    def scalars(self, step: int, values: dict[str, float]) -> None:
        def write(w: Any) -> None:
            for tag, value in values.items():
                if value is not None and not (isinstance(value, float) and math.isnan(value) and tag != "loss"):
                    w.add_scalar(tag, value, step)

        self._call(write)

    def event(self, step: int, record: dict[str, Any]) -> None:
        name = str(record["event"])
        self.counts[name] = self.counts.get(name, 0) + 1

        def write(w: Any) -> None:
            w.add_scalar(f"events/{name}", self.counts[name], step)
            w.add_text("events", json.dumps(record, default=str), step)

        self._call(write)

    def flush(self) -> None:
        self._call(lambda w: w.flush())

    def close(self) -> None:
        self._call(lambda w: w.close())
        self.writer = None


def tensorboard_installed() -> bool:
    """Whether ``torch.utils.tensorboard`` imports (it needs the ``tensorboard`` package)."""
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:
        return False
    return True


def open_sinks(folder: Path, process_rank: int, pp_rank: int, tensorboard: bool) -> list[Sink]:
    """This process's sinks under ``folder``: ``rank{R}.jsonl`` and, if asked and installed, ``rank{R}/``."""
    failed = Failures()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        failed(folder, err)
        return []
    sinks: list[Sink] = [
        JsonLines(folder / f"rank{process_rank}.jsonl", {"rank": process_rank, "pp_rank": pp_rank}, failed)
    ]
    if not tensorboard:
        return sinks
    if not tensorboard_installed():
        if process_rank == 0:
            log.warning(
                "stagewise metrics: TensorBoard is not installed (pip install tensorboard); metrics go to %s only",
                folder / "rank*.jsonl",
            )
        return sinks
    sinks.append(TensorBoard(folder / f"rank{process_rank}", failed))
    return sinks
