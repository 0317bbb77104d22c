"""A machine's snapshot folder: ``<root>/stagewise-<run id>/``, its files written whole or not at all.

One file per rank and generation, ``<step>-<lineage>-r<owner>.snap``: this machine's ranks' own and the
copies its peers sent. A file is written under a dot-name and renamed into place, so a reader sees a
whole file or none (:func:`write`, or in place through the file's mapped pages: :mod:`.mapped`); a writer
killed half-way leaves a ``.tmp`` that nothing reads and the next prune removes. The folder lives as long as
the machine's memory file system: across worker restarts, not across the loss of the machine.

A job that ends cleanly removes its files and leaves ``ended-<job>.json`` (a few bytes): a machine that was
lost before the end and comes back still holds that job's files, and a later job of the same name must not
resume from them (:func:`ended`; a resume gathers every machine's markers and refuses those files).
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .snapshot_file import HEAD_FIXED, SnapshotRefused, head_size, read_header

_NAME = re.compile(r"^\.?(\d{10})-([0-9a-f]+)-r(\d{5})\.snap(\.tmp)?$")
_ENDED = re.compile(r"^ended-([0-9a-f]+)\.json$")
_SPARE_PREFIX = ".spare-"  # a retired generation's file, to be written over (no step: prune leaves it)


@dataclass(frozen=True)
class Found:
    """A snapshot file in this machine's folder, and what its header says."""

    path: Path
    header: dict[str, Any]


def machine_folder(root: Path, run: str) -> Path:
    """``root/stagewise-<run>`` (the run id with anything but letters, digits, ``.``, ``_`` and ``-`` replaced)."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", run) or "run"
    return root / f"stagewise-{safe}"


def identity(root: Path) -> str:
    """Which folder ``root`` is on this boot of this host (the boot, the device and the inode: a path names other
    folders on other machines, one folder on machines that are processes of one host); "" where it is not yet."""
    try:
        st = root.stat()
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""
    return f"{boot}:{st.st_dev}:{st.st_ino}"


def refuse_shared(everyone: list[dict[str, Any]], root: Path) -> None:
    """Refuse (on every rank alike: ``everyone`` is the gathered ``machine`` and ``folder`` of each rank) machines
    that keep their snapshots in one folder: a machine's copies would not outlive it, and the writers take each
    other's files (on two agents of one host sharing ``/dev/shm``: a generation failed every two steps, 58 times)."""
    by_folder: dict[str, set[str]] = {}
    for e in everyone:
        if e.get("folder"):
            by_folder.setdefault(str(e["folder"]), set()).add(str(e["machine"]))
    shared = sorted(sorted(machines) for machines in by_folder.values() if len(machines) > 1)
    if shared:
        them = "; ".join(f"machines {', '.join(m)}" for m in shared)
        raise ValueError(
            f"snapshot=: {them} keep their snapshots in one folder ({root} on one host): each machine's copies "
            "must live in its own memory, or a lost machine's copies go with its peer's; give each machine its own "
            "folder (STAGEWISE_SNAPSHOT_DIR, or Snapshots(folder=...)) where machines are processes of one host"
        )


def file_name(step: int, lineage: str, owner: int) -> str:
    return f"{step:010d}-{lineage}-r{owner:05d}.snap"


def is_file_name(name: str) -> bool:
    """Whether ``name`` is a whole snapshot file's name, as :func:`file_name` makes them (no dot-name, no path)."""
    m = _NAME.fullmatch(name)
    return m is not None and not name.startswith(".") and m.group(4) is None


def write(folder: Path, name: str, head: bytes, payload: memoryview, spare: Path | None = None) -> Path:
    """Write ``head`` then ``payload`` as ``folder/name``, whole or not at all (a dot-name renamed into place).
    ``spare``: a file to write over instead of a new one, when it is there (:func:`retire`)."""
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / name
    staging = folder / f".{name}.tmp"
    mode = "wb"
    if spare is not None:
        try:
            os.replace(spare, staging)
            mode = "r+b"
        except FileNotFoundError:  # none yet, or pruned by another rank of this machine
            pass
    with open(staging, mode) as f:
        f.write(head)
        f.write(payload)
        f.truncate()
    os.replace(staging, final)
    return final


def spare_name(writer: int, source: int) -> str:
    """The spare file of group rank ``writer`` for the copies of ``source``'s snapshots (its own: itself)."""
    return f"{_SPARE_PREFIX}w{writer:05d}-r{source:05d}"


def retire(path: Path, spare: Path) -> None:
    """``path``, a generation no longer kept, becomes ``spare``: the next generation is written over it. A
    memory file system's new pages cost more than the bytes copied into them (about 4 times on the 2-core
    VM), and freeing them again costs half as much: written over, the same pages serve every generation."""
    try:
        os.replace(path, spare)
    except FileNotFoundError:  # another rank of this machine pruned it first
        pass


class Written:
    """The snapshot files one writer (group rank ``writer``) wrote into ``folder``, by source: the two newest of
    each kept, the one before retired into that source's spare, which the next is written over."""

    def __init__(self, folder: Path, writer: int) -> None:
        self.folder, self.writer = folder, writer
        self.files: dict[int, list[Path]] = {}

    def spare(self, source: int) -> Path:
        return self.folder / spare_name(self.writer, source)

    def keep(self, source: int, path: Path) -> None:
        kept = [p for p in self.files.setdefault(source, []) if p != path] + [path]
        while len(kept) > 2:
            retire(kept.pop(0), self.spare(source))
        self.files[source] = kept


def remove_spares(folder: Path) -> None:
    """Remove the spare files (a clean end)."""
    if folder.is_dir():
        remove(p for p in folder.iterdir() if p.name.startswith(_SPARE_PREFIX))


def inventory(folder: Path) -> tuple[list[Found], list[tuple[Path, str]]]:
    """Every whole snapshot file here with its header (checked against its digest), and the refused ones with
    why (a header that is cut short or corrupted)."""
    found: list[Found] = []
    refused: list[tuple[Path, str]] = []
    if not folder.is_dir():
        return found, refused
    for path in sorted(folder.iterdir()):
        m = _NAME.match(path.name)
        if m is None or m.group(4) or path.name.startswith("."):
            continue
        try:
            found.append(Found(path, _header(path)))
        except (OSError, SnapshotRefused, ValueError) as err:
            refused.append((path, str(err)))
    return found, refused


def _header(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        prefix = f.read(HEAD_FIXED)
        return read_header(prefix + f.read(head_size(prefix) - HEAD_FIXED))[0]


def prune(folder: Path, below: int) -> list[Path]:
    """Remove the snapshot files (and left-over ``.tmp`` files) of steps below ``below``; what was removed."""
    removed: list[Path] = []
    if not folder.is_dir():
        return removed
    for path in folder.iterdir():
        m = _NAME.match(path.name)
        if m is not None and int(m.group(1)) < below:
            try:
                path.unlink()
                removed.append(path)
            except FileNotFoundError:  # another rank of this machine pruned it first
                pass
    return removed


def remove(paths: Iterable[Path]) -> None:
    for path in paths:
        try:
            path.unlink()
        except FileNotFoundError:
            pass


def mark_ended(folder: Path, job: str, step: int) -> None:
    """Leave ``ended-<job>.json`` here: this job ended cleanly at ``step`` (written whole, by any rank; nothing
    where the job never wrote a snapshot)."""
    if not re.fullmatch(r"[0-9a-f]+", job) or not folder.is_dir():
        return
    staging = folder / f".ended-{job}.{os.getpid()}.tmp"
    staging.write_text(json.dumps({"job": job, "step": step, "time": time.time()}))
    os.replace(staging, folder / f"ended-{job}.json")


def ended(folder: Path) -> dict[str, int]:
    """The jobs that ended cleanly with this machine among them: ``{job: its last step}``."""
    out: dict[str, int] = {}
    if not folder.is_dir():
        return out
    for path in folder.iterdir():
        m = _ENDED.match(path.name)
        if m is None:
            continue
        try:
            out[m.group(1)] = int(json.loads(path.read_text())["step"])
        except (OSError, ValueError, KeyError, TypeError):
            out[m.group(1)] = -1  # a marker cut short still says the job ended
    return out
