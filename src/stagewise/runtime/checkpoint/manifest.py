"""Integrity: a SHA-256 per file, recorded in ``MANIFEST.json``, the last file written into a checkpoint.

A checkpoint without a manifest is partial (its save never finished, or the
file was removed); a file whose size or digest differs from the manifest's is
corrupted; a file the manifest does not list was put there afterwards. All
three are refused, naming the file. No torch here: plain files and hashlib.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

MANIFEST = "MANIFEST.json"
FORMAT = "stagewise-checkpoint"
VERSION = 1
_CHUNK = 1 << 20


class CheckpointError(ValueError):
    """A checkpoint that cannot be written, or must not be loaded (partial, corrupted, or for another model)."""


def digest(path: Path) -> dict[str, object]:
    """``{"bytes": size, "sha256": hex}`` of one file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return {"bytes": size, "sha256": h.hexdigest()}


def files_of(folder: Path) -> list[str]:
    """The checkpoint's files (names relative to ``folder``, sorted), the manifest excepted."""
    out = []
    for root, _, names in os.walk(folder):
        for name in names:
            rel = os.path.relpath(os.path.join(root, name), folder)
            if rel != MANIFEST:
                out.append(rel)
    return sorted(out)


def digests(folder: Path, names: Iterable[str]) -> dict[str, dict[str, object]]:
    return {name: digest(folder / name) for name in names}


def share(names: Sequence[str], rank: int, ranks: int) -> list[str]:
    """The files rank ``rank`` of ``ranks`` hashes: every ``ranks``-th, so the reading is spread over the ranks."""
    return list(names[rank::ranks])


def write_manifest(folder: Path, files: dict[str, dict[str, object]]) -> None:
    """Write ``MANIFEST.json`` (to a temporary name, flushed to disk, then renamed: it appears whole or not at all)."""
    body = json.dumps({"format": FORMAT, "version": VERSION, "files": dict(sorted(files.items()))}, indent=1)
    write_durably(folder / MANIFEST, body)


def write_durably(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def generation_of(folder: Path | None, record: str) -> int:
    """The membership generation a checkpoint's record (the file ``record`` in ``folder``) names: 0 when it
    names none (saved before it was recorded) or cannot be read here (its load says why)."""
    if folder is None:
        return 0
    try:
        return int(json.loads((folder / record).read_text()).get("generation", 0))
    except (OSError, ValueError, AttributeError):
        return 0


def read_manifest(folder: Path) -> dict[str, dict[str, object]]:
    """The files the manifest lists; raises :class:`CheckpointError` if it is missing or unreadable."""
    path = folder / MANIFEST
    if not path.is_file():
        raise CheckpointError(
            f"checkpoint {folder} is partial: it has no {MANIFEST} (its save did not finish, or the file was removed)"
        )
    try:
        body = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"checkpoint {folder}: {MANIFEST} is unreadable ({err})") from err
    if not isinstance(body, dict) or body.get("format") != FORMAT or not isinstance(body.get("files"), dict):
        raise CheckpointError(f"checkpoint {folder}: {MANIFEST} is not a {FORMAT} manifest")
    if body.get("version") != VERSION:
        raise CheckpointError(
            f"checkpoint {folder}: manifest version {body.get('version')}, this stagewise reads version {VERSION}"
        )
    return body["files"]


def check_files(folder: Path, expected: dict[str, dict[str, object]], names: Iterable[str]) -> list[str]:
    """Problems with the files ``names`` (a share of ``expected``): missing, wrong size, wrong digest."""
    problems = []
    for name in names:
        path = folder / name
        if not path.is_file():
            problems.append(f"file {path} is missing")
            continue
        want = expected[name]
        size = path.stat().st_size
        if size != want.get("bytes"):
            problems.append(f"file {path} is corrupted: {size} bytes, the manifest says {want.get('bytes')}")
            continue
        got = digest(path)["sha256"]
        if got != want.get("sha256"):
            problems.append(f"file {path} is corrupted: its sha256 is {got}, the manifest says {want.get('sha256')}")
    return problems


def unlisted(folder: Path, expected: dict[str, dict[str, object]]) -> list[str]:
    """Files in ``folder`` that the manifest does not list (written after the checkpoint was sealed)."""
    return [f"file {folder / name} is not in the manifest" for name in files_of(folder) if name not in expected]
