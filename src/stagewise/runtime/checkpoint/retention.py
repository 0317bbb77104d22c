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

import difflib
import json
import os
import re
import shutil
import warnings
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
    for orphan in root.glob(".step-*.tmp.owner"):  # a claim whose folder is gone (published, or removed)
        if not orphan.with_name(orphan.name.removesuffix(".owner")).exists():
            orphan.unlink(missing_ok=True)
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


def nothing_at(path: Path) -> str:
    """Why no checkpoint is at ``path``, with what the user likely meant: a step folder's full name
    (``step-8`` is ``step-00000008``), a model saved in parts (a HetPipe's ``vw0/``, ``vw1/``), or no folder."""
    said = f"no checkpoint at {path}: neither a checkpoint folder nor a folder holding step-* ones"
    digits = path.name.removeprefix("step-")
    if digits != path.name and digits.isdigit() and folder_for(path.parent, int(digits)).exists():
        return f"{said}; step folders are named with 8 digits: {folder_for(path.parent, int(digits))}"
    near = misspelt(path)
    if near is not None:
        return f"{said}; {near} holds checkpoints: a misspelt path?"
    if not path.is_dir():
        return f"{said} ({'a file, not a folder' if path.exists() else 'no such folder'})"
    parts = sorted(p.name for p in path.iterdir() if p.is_dir() and steps(p))
    if parts:
        return (
            f"{said}; it holds checkpoints in parts ({', '.join(parts)}: a HetPipe saves each virtual worker's "
            f"pipeline under its own folder): load it into the same HetPipe, or one part ({path / parts[0]}) "
            "into a Pipeline"
        )
    return said


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
    _owner_of(staging).unlink(missing_ok=True)  # (its claim: a Ctrl-C before the sweep left it for good)
    _sync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def prune(root: Path, keep: int | None, current: Path) -> list[Path]:
    """Keep ``current`` (just written) and the newest ``keep - 1`` other complete checkpoints by step before it;
    delete the older rest. Returns what was deleted. A checkpoint of a later step than ``current`` is another
    run's (one that this run did not resume from): never deleted (a run that forgot to resume, saving step 2 with
    ``keep=1`` into a folder holding step 100, deleted step 100); :func:`newer_than` says so."""
    if keep is None:
        return []
    others = [path for step, path in steps(root) if path != current and step < _step_of(current)]
    doomed = others[: max(0, len(others) - (keep - 1))]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def job_of(folder: Path, record: str) -> str | None:
    """The job that saved the checkpoint ``folder`` (its ``record`` file's ``job``), "" where there is none, None
    where it does not say (a save before jobs were recorded, or a record that cannot be read)."""
    if not folder.exists():
        return ""
    try:
        return str(json.loads((folder / record).read_text())["job"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def newer_than(root: Path, current: Path) -> list[int]:
    """The complete checkpoints' steps under ``root`` later than ``current``'s (a resume would take the newest)."""
    return [step for step, path in steps(root) if step > _step_of(current)]


def warn_unexpected(root: Path, current: Path, replaced: bool) -> None:
    """A warning where a save did what its caller may not have meant: it replaced another job's save of the same
    step (every file of that folder; a job's own re-save, a step redone after a loss, is not worth one), or the
    folder holds later steps (a run that forgot to resume: a resume takes those)."""
    newer = newer_than(root, current)
    if newer:
        warnings.warn(
            f"checkpoint {current.name} saved under {root}, which holds later steps ({', '.join(map(str, newer))}): "
            f"a resume takes step {newer[-1]}, not this one, and keep= removes none of them; did this run skip "
            "sw.checkpoint.resume?",
            stacklevel=4,
        )
    if replaced:
        warnings.warn(f"checkpoint {current.name} under {root} replaced an earlier save of the same step", stacklevel=4)


def _step_of(folder: Path) -> int:
    return int(folder.name.removeprefix("step-"))


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


def misspelt(root: Path) -> Path | None:
    """A folder beside a missing ``root`` whose name is close to its name and that holds ``step-N`` checkpoints
    (``ckpts`` for ``ckpt``), or None: a resume that starts afresh there is probably a typo."""
    if root.exists() or not root.parent.is_dir():
        return None
    try:
        names = [p.name for p in root.parent.iterdir() if p.is_dir()]
    except OSError:  # an unreadable folder: no evidence
        return None
    near = (root.parent / name for name in difflib.get_close_matches(root.name, names, n=3, cutoff=0.75))
    return next((p for p in near if _a_typo(root.name, p.name) and steps(p)), None)


def _a_typo(wanted: str, found: str) -> bool:
    """Whether ``found`` is ``wanted`` with a slip of the keyboard: at most two characters changed, added or dropped
    (a doubled or swapped letter: ``ckpts``, ``chekcpoints``), none a digit. A name in a series (``run2`` beside a new
    ``run3``, ``ck_r0term`` beside ``ck_lterm``) is another job's folder, which a warning would wrongly blame."""
    edits = [
        (wanted[i1:i2], found[j1:j2])
        for op, i1, i2, j1, j2 in difflib.SequenceMatcher(None, wanted, found).get_opcodes()
        if op != "equal"
    ]
    size = sum(max(len(a), len(b)) for a, b in edits)  # a swap ("nu" for "un") is two
    changed = "".join(a + b for a, b in edits)
    return 0 < size <= 2 and not any(c.isdigit() for c in changed)
