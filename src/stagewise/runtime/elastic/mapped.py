"""A snapshot file written in place: its pages mapped, the payload filled (or received) straight into them.

The old way, a payload went into a host buffer and then a second time into the file (37 MiB: ~10 ms of CPU on
each side of a copy). Here the file under its dot-name (:mod:`.folder`: the spare, renamed) is mapped, the fill
or the peer's bytes land in its pages, the head is written at its start, and the rename makes it visible whole
as before. The head is padded (spaces after the JSON, which a reader of either format reads past) to ``room``
bytes, a multiple of the page size kept from generation to generation, so the file's size stays the same and its
mapping - and the fill's views of it (:class:`.snapshot_file.Places`) - are kept by inode: the two newest
generations and the spare are the same three files over and over.

A file whose mapping cannot be reused (its size changed, or another writer's) is mapped anew; a head that does
not fit its room (never, short of a header that grew past a page between two lines) is written the old way.
"""

from __future__ import annotations

import mmap
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .snapshot_file import Places, host_bytes

PAGE = mmap.PAGESIZE
_SLACK = 1024  # room for the header to grow (step digits, the generators' states) without a new size
_KEPT = 3  # mappings kept per source: the two newest generations and the spare


@dataclass(eq=False)
class Mapping:
    """One file's pages (uint8 over the whole file) and where the last fill's tensors went in them."""

    size: int
    data: torch.Tensor
    places: Places | None = None


@dataclass(eq=False)
class Staged:
    """One file being written under its dot-name: its mapping, the head's room and the payload's length."""

    staging: Path
    mapping: Mapping
    room: int
    total: int
    key: tuple[int, int] = field(default=(0, 0))

    @property
    def payload(self) -> torch.Tensor:
        return self.mapping.data[self.room : self.room + self.total]


def room_for(need: int, kept: int) -> int:
    """The head's room: ``kept`` while ``need`` fits it, else ``need`` and some slack rounded up to a page."""
    return kept if need <= kept else -(-(need + _SLACK) // PAGE) * PAGE


class Files:
    """One writer's mapped files, by source and inode (at most :data:`_KEPT` each)."""

    def __init__(self) -> None:
        self.maps: dict[int, OrderedDict[tuple[int, int], Mapping]] = {}

    def stage(self, source: int, folder: Path, name: str, spare: Path, room: int, total: int) -> Staged:
        """``folder/.name.tmp`` (``spare`` renamed, or a new file) sized ``room + total`` and mapped."""
        folder.mkdir(parents=True, exist_ok=True)
        staging = folder / f".{name}.tmp"
        try:
            os.replace(spare, staging)
        except FileNotFoundError:  # none yet, or pruned by another rank of this machine
            pass
        size = room + total
        kept = self.maps.setdefault(source, OrderedDict())
        fd = os.open(staging, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            st = os.fstat(fd)
            key = (st.st_dev, st.st_ino)
            found = kept.pop(key, None)
            if found is None or found.size != size or st.st_size != size:
                if st.st_size != size:
                    os.ftruncate(fd, size)
                flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)  # (the page tables at once)
                found = Mapping(size, torch.frombuffer(mmap.mmap(fd, size, flags=flags), dtype=torch.uint8))
        finally:
            os.close(fd)
        kept[key] = found
        while len(kept) > _KEPT:
            kept.popitem(last=False)
        return Staged(staging, found, room, total, key)

    def forget(self, source: int, staged: Staged) -> None:
        """``staged``'s mapping is not reused (its file was written another way, or thrown away)."""
        self.maps.get(source, OrderedDict()).pop(staged.key, None)


def publish(files: Files, source: int, staged: Staged, head: bytes, body: torch.Tensor | None, final: Path) -> Path:
    """``staged`` as ``final``, whole: ``head`` written into its room (``body``: its payload, received or filled
    in place), then the rename. A head of another length, or a body elsewhere, is written the old way."""
    if body is None:
        in_place = staged.total == 0
    else:
        in_place = body.data_ptr() == staged.payload.data_ptr() and body.numel() == staged.total
    if len(head) == staged.room and in_place:
        host_bytes(staged.mapping.data)[: staged.room] = head
    else:
        data = bytes(host_bytes(body)) if body is not None else b""  # (a copy: body may be this file's pages)
        files.forget(source, staged)
        with open(staged.staging, "r+b") as f:
            f.write(head)
            f.write(data)
            f.truncate()
    os.replace(staged.staging, final)
    return final


def discard(files: Files, source: int, staged: Staged) -> None:
    """A staged file not published (its bytes failed): removed, its mapping forgotten (a transfer given up may
    still write into those pages; a new file serves the next generation)."""
    files.forget(source, staged)
    try:
        staged.staging.unlink()
    except FileNotFoundError:
        pass
