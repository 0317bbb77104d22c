"""One rank's snapshot as bytes: a JSON header (what, whose, which step and layout) and the tensors' raw bytes.

::

    b"SWSNAP1\\n"  header length (8 bytes, little-endian)  SHA-256 of the header (32 bytes)
    header: JSON - run, lineage, step, owner rank, world, layout, each tensor's dtype/shape/offset,
            the optimizer's hyper-parameters and non-tensor state, the generators' states, the data
            position, and the payload's length and CRC-32 (``payload_crc32``; a file written before it holds
            the payload's SHA-256, ``payload_sha256``, and is read as before)
    payload: the tensors' bytes, one after the other

The header's digest covers the header, and the header holds the payload's checksum, so one flipped bit
anywhere - or a file cut short - is refused (:class:`SnapshotRefused`), never loaded. The payload's check is
a CRC-32, not a SHA-256: it guards against damage (a CRC-32 catches every error burst up to 32 bits, so every
flipped bit or byte, and anything else but 1 in 2**32 of random damage), not against someone forging a file in
this job's own memory folder, and it costs well under half the SHA-256's CPU on every snapshot's path (zlib;
37 MiB: ~10 ms against ~22 ms on one core). A header names its
generation (``lineage``, ``step``): the lineage is drawn when the pipeline is built, so two runs that both
reached step 10 (one of them after resuming from step 8 at another layout) never mix their parts. It also
names the membership ``generation`` that trained the state (:func:`..comm.generations.recorded`; a file written
before it was recorded reads as 0: :func:`generation_of`). Nothing is unpickled: the header is JSON, tensors
are rebuilt from dtype, shape and bytes.
"""

from __future__ import annotations

import hashlib
import json
import struct
import zlib
from collections.abc import Mapping
from typing import Any, cast

import torch

from ..comm.generations import recorded

MAGIC = b"SWSNAP1\n"
HEAD_FIXED = len(MAGIC) + 8 + 32  # magic, header length, header digest
_ALIGN = 64  # each tensor's bytes start at a multiple of this (a view as any dtype is aligned)


class SnapshotRefused(Exception):
    """A snapshot file that cannot be trusted: cut short, corrupted, or not a snapshot."""


def layout_payload(tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, dict[str, Any]], int]:
    """Where each tensor's bytes go in the payload (``{name: {dtype, shape, offset, nbytes}}``) and its length."""
    entries: dict[str, dict[str, Any]] = {}
    at = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        dtype = str(t.dtype).removeprefix("torch.")
        entries[name] = {"dtype": dtype, "shape": list(t.shape), "offset": at, "nbytes": nbytes}
        at += -(-nbytes // _ALIGN) * _ALIGN
    return entries, at


class Layout:
    """One payload layout, kept from snapshot to snapshot while its tensors' names, dtypes and shapes hold: the
    entries, the payload's length and the entries' JSON (per tensor, these cost more than the copy at 2 MiB)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.key = layout_key(tensors)
        self.entries, self.total = layout_payload(tensors)
        self.text = json.dumps(self.entries, separators=(",", ":"))


def layout_key(tensors: Mapping[str, torch.Tensor]) -> tuple[tuple[str, torch.dtype, tuple[int, ...]], ...]:
    """What a payload's layout depends on: each tensor's name, dtype and shape, in order."""
    return tuple((name, t.dtype, tuple(t.shape)) for name, t in tensors.items())


def layout_for(kept: Layout | None, tensors: Mapping[str, torch.Tensor]) -> Layout:
    """``kept`` while it is ``tensors``' layout, else a new one."""
    if kept is not None and kept.key == layout_key(tensors):
        return kept
    return Layout(tensors)


def fill_payload(
    buffer: torch.Tensor, tensors: Mapping[str, torch.Tensor], entries: Mapping[str, Any], places: Places | None = None
) -> Places:
    """Copy each tensor's bytes into ``buffer`` (uint8, on the host) at its offset, in one call (non-blocking from
    a GPU into pinned memory: the caller waits on the copy stream). Returns where each went (views of ``buffer``
    as the tensors' dtypes and shapes), which a caller passes back for the next payload of the same layout into
    the same buffer: built per tensor, they cost more than the copy itself at a few MiB."""
    if places is None or not places.fits(buffer, entries):
        places = Places(buffer, entries)
    with torch.no_grad():  # (no per-tensor detach: the views record no history)
        torch._foreach_copy_(places.views, [tensors[n] for n in places.names], non_blocking=True)
    return places


class Places:
    """Where each tensor of one payload layout goes in one buffer: views of it, kept from snapshot to snapshot."""

    def __init__(self, buffer: torch.Tensor, entries: Mapping[str, Any]) -> None:
        self.entries, self.ptr = dict(entries), buffer.data_ptr()
        self.names = [n for n, e in entries.items() if e["nbytes"]]
        self.views = [_view(buffer, entries[n]) for n in self.names]

    def fits(self, buffer: torch.Tensor, entries: Mapping[str, Any]) -> bool:
        return buffer.data_ptr() == self.ptr and entries == self.entries


def _view(buffer: torch.Tensor, e: Mapping[str, Any]) -> torch.Tensor:
    return buffer[e["offset"] : e["offset"] + e["nbytes"]].view(getattr(torch, e["dtype"])).view(e["shape"])


def host_buffer(kept: torch.Tensor | None, size: int, pinned: bool) -> torch.Tensor:
    """One host buffer of at least ``size`` bytes, ``kept`` from snapshot to snapshot (pinned for copies from a GPU)."""
    if kept is None or kept.numel() < size:
        return torch.empty(max(size, 1), dtype=torch.uint8, pin_memory=pinned)
    return kept


def header_bytes(header: dict[str, Any], payload: torch.Tensor, room: int = 0, layout: Layout | None = None) -> bytes:
    """The file's head: magic, length, digest and the header, which records the payload's length and digest (and
    the membership generation, unless the caller's header names it). ``room``: the head padded to that many
    bytes when it fits (spaces after the JSON: every reader reads past them; see :mod:`.mapped`). ``layout``:
    the header's ``tensors`` (its last key), whose kept JSON is used as it is."""
    view = host_bytes(payload)
    return _head(header, len(view), zlib.crc32(view), room, layout)


def head_need(header: dict[str, Any], nbytes: int) -> int:
    """The most bytes :func:`header_bytes` takes for ``header`` over ``nbytes`` of payload, whatever its CRC."""
    return len(_head(header, nbytes, 0xFFFFFFFF, 0))


def _head(header: dict[str, Any], nbytes: int, crc: int, room: int, layout: Layout | None = None) -> bytes:
    ends = {"payload_bytes": nbytes, "payload_crc32": crc}
    if layout is None or header.get("tensors") is not layout.entries:
        header = {"generation": recorded(), **header, **ends}
        text = json.dumps(header, separators=(",", ":"), allow_nan=True).encode()
    else:  # the same bytes as above when ``tensors`` is the header's last key (it is: see .snapshots)
        rest = {"generation": recorded(), **{k: v for k, v in header.items() if k != "tensors"}}
        known = json.dumps(rest, separators=(",", ":"), allow_nan=True)[:-1]
        text = f'{known},"tensors":{layout.text},{json.dumps(ends, separators=(",", ":"))[1:]}'.encode()
    text += b" " * max(room - HEAD_FIXED - len(text), 0)
    return MAGIC + struct.pack("<Q", len(text)) + hashlib.sha256(text).digest() + text


def versions(tensors: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """Each tensor's version counter (every in-place write adds one; a view shares its base's)."""
    return {name: int(t._version) for name, t in tensors.items()}


def generation_of(header: Mapping[str, Any]) -> int:
    """The membership generation a snapshot's header names (0 for a file written before it was recorded)."""
    return int(header.get("generation", 0))


def host_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a uint8 tensor in host memory, without a copy."""
    return memoryview(cast(Any, t.numpy())) if t.numel() else memoryview(b"")


def head_size(prefix: bytes) -> int:
    """How many bytes the head of a snapshot takes, from its first :data:`HEAD_FIXED` bytes."""
    _check_prefix(prefix)
    return HEAD_FIXED + int(struct.unpack("<Q", prefix[len(MAGIC) : len(MAGIC) + 8])[0])


def read_header(data: bytes | memoryview) -> tuple[dict[str, Any], int]:
    """The header of a snapshot's bytes (checked against its digest) and where its payload starts."""
    text = checked_header(data)
    return json.loads(text), HEAD_FIXED + len(text)


def checked_header(data: bytes | memoryview) -> bytes:
    """The header's JSON text of a snapshot's bytes, checked against its digest, not parsed."""
    data = memoryview(data)
    _check_prefix(bytes(data[:HEAD_FIXED]))
    (length,) = struct.unpack("<Q", data[len(MAGIC) : len(MAGIC) + 8])
    digest = bytes(data[len(MAGIC) + 8 : HEAD_FIXED])
    text = bytes(data[HEAD_FIXED : HEAD_FIXED + length])
    if len(text) != length or hashlib.sha256(text).digest() != digest:
        raise SnapshotRefused("its header is cut short or corrupted (SHA-256 mismatch)")
    return text


def _check_prefix(prefix: bytes) -> None:
    if prefix[: len(MAGIC)] != MAGIC:
        raise SnapshotRefused("not a stagewise snapshot (no SWSNAP1 header)")
    if len(prefix) < HEAD_FIXED:
        raise SnapshotRefused(f"its header is cut short ({len(prefix)} bytes)")


def verified(data: bytes | memoryview) -> tuple[dict[str, Any], memoryview]:
    """The header and the payload of a whole snapshot, both checked against their digests."""
    header, start = read_header(data)
    payload = memoryview(data)[start:]
    if len(payload) != header["payload_bytes"]:
        raise SnapshotRefused(f"its payload is {len(payload)} bytes, the header says {header['payload_bytes']}")
    if "payload_crc32" in header:
        if zlib.crc32(payload) != header["payload_crc32"]:
            raise SnapshotRefused("its payload is corrupted (CRC-32 mismatch)")
    elif hashlib.sha256(payload).hexdigest() != header.get("payload_sha256"):  # (a file written before the CRC-32)
        raise SnapshotRefused("its payload is corrupted (SHA-256 mismatch)")
    return header, payload


def tensors_of(header: Mapping[str, Any], payload: memoryview) -> dict[str, torch.Tensor]:
    """The tensors a verified payload holds, each a copy (the buffer may go)."""
    out: dict[str, torch.Tensor] = {}
    raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if len(payload) else torch.empty(0, dtype=torch.uint8)
    for name, e in header["tensors"].items():
        dtype = getattr(torch, e["dtype"])
        piece = raw[e["offset"] : e["offset"] + e["nbytes"]]
        out[name] = piece.view(dtype).reshape(e["shape"]) if e["nbytes"] else torch.empty(e["shape"], dtype=dtype)
    return out
