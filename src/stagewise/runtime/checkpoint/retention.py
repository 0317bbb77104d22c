"""Where checkpoints live under a root folder: one ``step-NNNNNNNN`` folder each, published by a rename.

A save writes into ``.step-NNNNNNNN.tmp`` and renames it into place once every
rank has finished and the manifest is written, so a folder named ``step-*``
is complete unless someone altered it (:func:`latest` also requires its
manifest). ``keep`` prunes the oldest complete checkpoints. No torch here.

Which checkpoint a load of a root folder (and ``resume``) takes is decided by
:func:`choose`, which says why: the newest ``step-N``. If that one has lost its
manifest, it is refused rather than passed over - falling back silently to an
older step would redo work nobody asked to redo, or hide a damaged disk - and
the error says how to fall back on purpose (move the damaged folder away). An
interrupted save (``.step-N.tmp`` newer than the chosen step) is normal after
a crash; it is named in the reason, and ignored - and removed by this job's next save (:func:`sweep`): the
saving rank names its job beside the staging folder (``.step-N.tmp.owner``), and a save removes the staging
folders its own job left (torch restarts all of a job's processes together, so no other attempt of it is
alive), never another job's, which may be writing now.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from .manifest import MANIFEST, CheckpointError

_NAME = re.compile(r"^step-(\d{8,})$")


def folder_for(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def staging_for(root: Path, step: int) -> Path:
    return root / f".step-{step:08d}.tmp"


def claim(staging: Path, job: str) -> None:
    """Name the job writing ``staging`` (beside it: the folder's files are the checkpoint's)."""
    _owner_of(staging).write_text(json.dumps({"job": job, "pid": os.getpid()}))


def sweep(root: Path, job: str, current: Path) -> list[Path]:
    """Remove the staging folders ``job`` left under ``root`` (its saves that died half-way), ``current``'s
    claim too (it is published); those of other jobs, and unclaimed ones, stay. Returns what was removed."""
    _owner_of(current).unlink(missing_ok=True)
    removed = []
    for staging in root.glob(".step-*.tmp"):
        try:
            owner = json.loads(_owner_of(staging).read_text())["job"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if owner == job and staging != current:
            shutil.rmtree(staging, ignore_errors=True)
            _owner_of(staging).unlink(missing_ok=True)
            removed.append(staging)
    return removed


def _owner_of(staging: Path) -> Path:
    return staging.with_name(staging.name + ".owner")


def steps(root: Path) -> list[tuple[int, Path]]:
    """The complete checkpoints under ``root`` (a manifest present), oldest first."""
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        m = _NAME.match(entry.name)
        if m and entry.is_dir() and (entry / MANIFEST).is_file():
            found.append((int(m.group(1)), entry))
    return sorted(found)


def latest(root: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint under ``root`` (its manifest present), or None if there is none.

    Completeness is the manifest's presence; :func:`stagewise.checkpoint.load` then verifies every file.
    """
    found = steps(Path(root))
    return found[-1][1] if found else None


def choose(root: Path) -> tuple[Path | None, str]:
    """The checkpoint a load of ``root`` takes (None if there is none), and why (see the module docstring);
    raises :class:`CheckpointError` if the newest ``step-N`` folder lacks its manifest."""
    if not root.is_dir():
        return None, f"{root} is not a folder"
    named = sorted((int(m.group(1)), e) for e in root.iterdir() if (m := _NAME.match(e.name)) and e.is_dir())
    if not named:
        return None, f"no step-N folder under {root}"
    step, newest = named[-1]
    complete = steps(root)
    if not (newest / MANIFEST).is_file():
        older = f"; to resume from {complete[-1][1].name}, move {newest.name} away" if complete else ""
        raise CheckpointError(
            f"the newest checkpoint under {root}, {newest.name}, is incomplete: it has no {MANIFEST} (removed, or "
            f"the disk lost it); refusing to fall back to an older one silently{older}"
        )
    why = f"the newest of {len(complete)} complete checkpoint{'s' if len(complete) > 1 else ''} under {root}"
    later = sorted(int(e.name[6:-4]) for e in root.glob(".step-*.tmp") if e.name[6:-4].isdigit())
    if later and later[-1] > step:
        why += f" (an interrupted save of step {later[-1]} is ignored: {staging_for(root, later[-1]).name})"
    return newest, why


def publish(staging: Path, final: Path) -> None:
    """Rename the finished ``staging`` folder to ``final`` (replacing an older save of the same step)."""
    old = None
    if final.exists():
        old = final.with_name(f".{final.name}.replaced")
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
    os.replace(staging, final)
    _sync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def prune(root: Path, keep: int | None, current: Path) -> list[Path]:
    """Keep ``current`` (just written) and the newest ``keep - 1`` other complete checkpoints by step; delete the
    rest. Returns what was deleted."""
    if keep is None:
        return []
    others = [path for _, path in steps(root) if path != current]
    doomed = others[: max(0, len(others) - (keep - 1))]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def check_keep(keep: int | None) -> None:
    if keep is not None and (not isinstance(keep, int) or keep < 1):
        raise ValueError(f"keep must be None (keep every checkpoint) or a count >= 1, got {keep!r}")


def _sync_dir(path: Path) -> None:
    """Flush a rename to disk (where the platform can open a directory)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
