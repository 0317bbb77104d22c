"""Ctrl-C on a job: one line, no tracebacks, exit status 130, nothing left in /dev/shm; and a failed job's cause.

What the terminal shows::

    $ stagewise run -n 4 train.py
    ^Cinterrupted: rank 2 stopped after step 37; last checkpoint ckpt/step-00000035

How: the terminal's SIGINT reaches the launcher only (torch's launcher starts every worker in a session of
its own); the launcher (:mod:`stagewise.runtime.launch`) forwards it to the workers and waits for them to
leave. A worker's ``KeyboardInterrupt`` ends at the exit hook
(:mod:`stagewise.runtime.comm.faults.exit_hook`), which calls :func:`stopped` instead of printing a
traceback: the worker writes where it stopped to the folder the launcher named in
``STAGEWISE_INTERRUPT_DIR`` and leaves the ordinary way, so that its exit handlers take its shared memory
out of /dev/shm. The launcher reads every worker's record and prints :func:`summary`: the rank furthest
behind (the step every rank has finished) and the newest checkpoint. Without the launcher (plain
``torchrun``), each worker prints its own line.

The same folder carries a failed job's first cause: every worker that learns of a failure (it raised, or read
another rank's on the error board) hands over the failure that stands (:func:`note_cause`), and ``stagewise
run`` prints its first line as the job's last line, under torch's summary of exit codes::

    stagewise run: rank 1 at 1F0: ValueError: the layer on rank 1 raised

Where a rank stands is counted here, process-wide: :func:`note_steps` after each trained step (mini-batches:
an asynchronous window counts each of its mini-batches), :func:`note_checkpoint` when a checkpoint is saved
or loaded; a loaded checkpoint's step is where the count goes on from (a restarted job resumes at it). The
measurements' probe pipelines (``calibrate()``, ``measure_compute_scale()``) train :func:`uncounted`.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

#: the folder the launcher reads the workers' records from (one JSON file per rank)
FOLDER_ENV = "STAGEWISE_INTERRUPT_DIR"
#: where a worker of an elastic job writes its traceback instead of the terminal (``<dir>/attempt-A/rank-R.PID.txt``)
TRACEBACK_ENV = "STAGEWISE_TRACEBACK_DIR"

_state: dict[str, Any] = {"steps": 0, "checkpoint": None, "here": 0}


def note_steps(count: int = 1) -> None:
    """This process finished ``count`` more training steps (mini-batches)."""
    _state["steps"] += count
    _state["here"] = _state.get("here", 0) + count  # trained in this process (a resume sets "steps" only)


def note_checkpoint(path: str | os.PathLike[str], step: int, *, loaded: bool = False) -> None:
    """A checkpoint of ``step`` was saved at ``path`` (``loaded``: was loaded from it: the count goes on from
    ``step``)."""
    _state["checkpoint"] = os.fspath(path)
    if loaded:
        _state["steps"] = step


@contextmanager
def uncounted() -> Iterator[None]:
    """Steps taken inside are not the job's training (the probes of ``calibrate()``): the count is put back."""
    saved = _state["steps"]
    try:
        yield
    finally:
        _state["steps"] = saved


def where() -> dict[str, Any]:
    """This process's record: global rank, steps finished, the last checkpoint saved or loaded (None: none)."""
    return {"rank": _rank(), "steps": _state["steps"], "checkpoint": _state["checkpoint"]}


def summary(records: Sequence[dict[str, Any]], signal_name: str = "SIGINT") -> str:
    """The one line: the rank with the fewest steps (the lowest such rank) and the newest checkpoint named."""
    head = "interrupted" if signal_name == "SIGINT" else f"stopped by {signal_name}"
    if not records:
        return f"{head}: no rank said where it stopped (interrupted before stagewise was set up)"
    behind = min(records, key=lambda r: (r["steps"], r["rank"]))
    saved = [r["checkpoint"] for r in records if r.get("checkpoint")]
    last = f"last checkpoint {_shown(max(saved, key=_checkpoint_order))}" if saved else "no checkpoint saved"
    return f"{head}: rank {behind['rank']} stopped after step {behind['steps']}; {last}"


def stopped() -> None:
    """This worker was interrupted: hand its record to the launcher, or (no launcher) print the line itself."""
    record = where()
    folder = os.environ.get(FOLDER_ENV)
    if folder and Path(folder).is_dir():
        path = Path(folder) / f"rank-{record['rank']}.json"
        partial = path.with_suffix(".tmp")
        partial.write_text(json.dumps(record))
        partial.replace(path)  # the launcher never reads half a record
        return
    print(summary([record]), file=sys.stderr, flush=True)


def note_cause(text: str) -> None:
    """The failure that stands in this job, as this worker knows it (its first line names the rank at fault, where
    it stood and what it raised): handed to the launcher, which prints it last. Every rank that knows the failure
    calls this; the first to write wins (each restart attempt has its own file)."""
    folder = os.environ.get(FOLDER_ENV)
    if not folder or not Path(folder).is_dir():
        return
    path = Path(folder) / f"cause-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}.txt"
    if path.exists():
        return
    partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        partial.write_text(text)
        os.link(partial, path)  # atomic, and refused when another rank's is there already
    except OSError:
        pass
    finally:
        partial.unlink(missing_ok=True)


def attempt() -> int:
    """This worker's restart attempt (torchrun's count; 0 outside torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def traceback_file() -> Path | None:
    """Where this worker writes its traceback (an elastic job's: ``stagewise run`` names the folder), or None."""
    folder = os.environ.get(TRACEBACK_ENV)
    if not folder or not Path(folder).is_dir():
        return None
    return Path(folder) / f"attempt-{attempt()}" / f"rank-{_rank()}.{os.getpid()}.txt"  # (a round may repeat A)


def note_failed(message: str, refusal: bool) -> None:
    """This worker leaves with ``message``: where it stood, and whether it is a refusal (raised before this
    process trained a step, not a failure of a peer): for ``stagewise run``'s line, which ends the job at once
    when every process of the machine refused."""
    folder = os.environ.get(FOLDER_ENV)
    if not folder or not Path(folder).is_dir():
        return
    here = _state.get("here", 0)
    record = {**where(), "here": here, "refusal": refusal and here == 0, "message": message}
    path = Path(folder) / f"failed-{attempt()}-r{record['rank']}.json"
    partial = path.with_suffix(".tmp")
    partial.write_text(json.dumps(record))
    partial.replace(path)


def failed(folder: str | os.PathLike[str], attempt: int) -> list[dict[str, Any]]:
    """The records of the workers of ``attempt`` that left with an error (:func:`note_failed`), by rank."""
    out = []
    for path in sorted(Path(folder).glob(f"failed-{attempt}-r*.json")):
        try:
            out.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return sorted(out, key=lambda r: r["rank"])


def first_cause(folder: str | os.PathLike[str]) -> str | None:
    """The first line of the failure the workers of the last attempt handed over (:func:`note_cause`), or None."""

    def attempt(p: Path) -> int:
        return int(p.stem.partition("-")[2] or 0)

    found = sorted(Path(folder).glob("cause-*.txt"), key=attempt)
    try:
        text = found[-1].read_text().strip() if found else ""
    except OSError:
        return None
    return text.splitlines()[0] if text else None


def records(folder: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The workers' records in ``folder`` (a record that cannot be read is left out)."""
    out = []
    for path in sorted(Path(folder).glob("rank-*.json")):
        try:
            out.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return out


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _checkpoint_order(path: str) -> tuple[str, str]:
    """Checkpoint folders are ``step-NNNNNNNN``: the newest has the largest name under its root."""
    p = Path(path)
    return p.name, str(p.parent)


def _shown(path: str) -> str:
    """A checkpoint's folder relative to the working directory when under it (shorter), else as saved."""
    try:
        return os.path.relpath(path) if not os.path.relpath(path).startswith("..") else path
    except ValueError:  # another drive
        return path
