"""The snapshot files as a source of the one listing (:mod:`.listing`): what a process lists of its machine's
files, and its reading of the ones the plan gives it (verified against their digests and against what was
listed), for a recovery's take-over and for a ``pipe.relayout`` a live owner cannot serve.

A file is listed by the first process of its machine only (one lister per folder); its names are the
take-over's (``model/NAME``, ``param:NAME`` for one parameter's optimizer state: :data:`.sources.PARAM`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..checkpoint import state
from ..elastic.folder import inventory
from ..elastic.snapshot_file import SnapshotRefused, host_bytes, tensors_of, verified
from ..elastic.snapshot_file import generation_of as snapshot_generation
from . import keys as K
from .sources import PARAM


@dataclass(frozen=True)
class Read:
    """One file's tensors by name, its optimizers' metadata, and its names by key (model tensors, units)."""

    tensors: Mapping[str, torch.Tensor]
    optim: Mapping[str, Any]
    names: tuple[dict[int, str], dict[int, str]]


@dataclass
class Files:
    """This process's part of the file source: its machine, the files it lists (:func:`listed`'s entries; empty
    on all but a machine's first process), and what it has read (by path)."""

    machine: str
    listed: list[dict[str, Any]] = field(default_factory=list)
    read: dict[str, Read] = field(default_factory=dict)

    def row(self) -> dict[str, Any]:
        """What every process learns of this one's files (JSON): its machine, each file's path, owner and keys."""
        files = [
            {"path": f["path"], "owner": f["owner"], "items": [list(i) for i in items_of(f["names"])]}
            for f in self.listed
        ]
        return {"machine": self.machine, "files": files}

    def take(self, paths: Iterable[str]) -> list[str]:
        """Read and verify ``paths`` (each listed here); the problems found (each refused alike by the caller)."""
        by_path = {f["path"]: f for f in self.listed}
        problems = []
        for path in sorted(set(paths)):
            try:
                self.read[path] = _read(by_path[path])
            except (OSError, SnapshotRefused) as err:
                problems.append(f"{path} on machine {self.machine}: {err}")
        return problems


def filed(rows: Sequence[Mapping[str, Any]]) -> tuple[list[K.Filed], list[str]]:
    """Every process's listed files (for :func:`.keys.plan`), and every process's machine."""
    out = [
        K.Filed(row["machine"], r, f["owner"], f["path"], frozenset((int(a), int(b)) for a, b in f["items"]))
        for r, row in enumerate(rows)
        for f in row["files"]
    ]
    return out, [row["machine"] for row in rows]


def items_of(names: Iterable[str]) -> list[K.Item]:
    """A file's names as the listing's keys: a model tensor by its name, a unit by its parameter's."""
    model = [(K.MODEL, K.key(n)) for n in names if n.startswith(state.MODEL)]
    return sorted(model + [(K.UNIT, K.key(n[len(PARAM) :])) for n in names if n.startswith(PARAM)])


def listed(folder: Path, machine: str, rank: int, generation: tuple[int, str] | None = None) -> list[dict[str, Any]]:
    """This machine's snapshot files by header (of one generation ``(step, lineage)`` if given): what the
    take-over's agreement chooses from, and what the listing reads them by."""
    out = []
    for f in inventory(folder)[0]:
        h = f.header
        if generation is not None and (h["step"], h["lineage"]) != generation:
            continue
        names = [*h["tensors"], *(PARAM + p for p in h["optimizer"]["params"])]
        fields = {k: h[k] for k in ("lineage", "step", "owner", "world", "layout")}
        out.append({**fields, "machine": machine, "holder": rank, "path": str(f.path), "job": h.get("job", "")})
        out[-1].update(names=names, dropout=h.get("dropout"), scheduler=h.get("scheduler"))
        out[-1]["membership"] = snapshot_generation(h)  # the membership generation that trained it
    return out


def _read(said: Mapping[str, Any]) -> Read:
    """One listed file, verified against its digests and against its listing (not replaced since)."""
    header, payload = verified(memoryview(Path(said["path"]).read_bytes()))
    if (header["lineage"], header["step"], header["owner"]) != (said["lineage"], said["step"], said["owner"]):
        raise SnapshotRefused("it was replaced since it was listed")
    raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if len(payload) else None
    tensors = tensors_of(header, host_bytes(raw) if raw is not None else memoryview(b""))
    optim = header["optimizer"]
    model = K.keyed([n for n in tensors if n.startswith(state.MODEL)], "tensors")
    return Read(tensors, optim, (model, K.keyed(optim["params"], "parameters")))
