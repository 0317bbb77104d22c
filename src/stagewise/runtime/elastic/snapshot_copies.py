"""A snapshot's copies between machines: this rank's sent to the next machine, the previous machine's written here.

The helper thread of :mod:`.snapshots` calls :func:`send` once its own file is written. A source's bytes are
received straight into the pages of their file under its dot-name (:mod:`.mapped`), staged from the label
its exchange's preamble carries (the file's name and payload length), so its head and its bytes are posted at
once; the head's digest is checked when it is in, before the file is made whole.
What arrived whole is written before any failure is raised, so that a copy the sender counts as delivered (a
committed step's only copy when the sender's machine is lost next) is never thrown away with the exchange that failed on
another peer. Once the run's failure is posted (:func:`..comm.faults.heartbeat.failure_posted`) or the
pipeline dropped, the exchange gives up on peers that have not begun their part: a survivor whose step
failed before its snapshot never will, and a recovery must not wait the timeout for it. A dropped
pipeline's helper writes nothing more (a listing for the next generation may be under way).

Then :func:`commit`: a step is **committed** once every rank's snapshot of it is written on its own machine and
on the next one (with one machine, on it): every rank that received its sources' copies whole and wrote them
says so in one all-reduce (each rank's copy has exactly one receiver, so when every receiver said so, every
copy landed). Only then does ``committed`` move; a rank whose exchange failed, or that was dropped, says
nothing, and the others' all-reduce ends without it (given up at the run's failure, or at the timeout).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from ..comm import groups, snapshot_exchange, snapshot_wire
from ..comm.faults import heartbeat
from . import folder as folders
from . import idle, mapped
from .snapshot_file import SnapshotRefused, checked_header, host_bytes, read_header


def deliver(snap: Any, step: int, head: bytes, payload: torch.Tensor, clock: idle.Clock, label: bytes = b"") -> None:
    """The helper's part after its own file: :func:`send`, then :func:`commit` (only if nothing failed)."""
    send(snap, head, payload, clock, label, step)
    commit(snap, step, clock)


def send(
    snap: Any, head: bytes, payload: torch.Tensor, clock: idle.Clock, label: bytes = b"", step: int | None = None
) -> None:
    """Head and payload, one exchange, to ``snap``'s next machine's rank (a :class:`.snapshots.Snapshotter`); the
    copies from the previous machine written here; then the first failure, if any, raised. ``label``:
    :func:`label` of this head's file (b"": none, the receiver parses the header); ``step``: the snapshot's,
    every source's too (their files' names are known before their preambles are in: :func:`_hints`)."""
    p = snap.peers
    if p.dest is None and not p.sources:
        return
    head_t = torch.frombuffer(bytearray(head), dtype=torch.uint8)
    wire: dict[str, Any] = {"give_up": _give_up(snap), "around": snap.priority.peer_thread, "lost": _lost(snap)}
    into = _Into(snap)
    done = snapshot_exchange.exchange_parts(
        [head_t, payload],
        p.dest,
        p.sources,
        snap.group,
        snap.timeout,
        into.place,
        note=label,
        **wire,
        agreed=snap._agreed,
        hints=_hints(snap, step),
    )
    staged = into.close()  # (a transfer still running past the deadline stages nothing more)
    clock.lap("send_s")
    refused: list[Exception] = []
    for src in p.sources:
        got, st = done.parts.get(src), staged.get(src)
        if got is None or len(got) < 2 or got[0] is None or snap.dropped:
            if st is not None:
                mapped.discard(snap._maps, src, st[1])
            continue  # nothing sent, or its head or bytes failed: no file (never a head without its bytes)
        got_head, body = got[0], got[1]
        data = got_head.numpy().tobytes()
        named = _labelled(done.notes.get(src, b""))  # (its preamble's: the staged name was the one expected)
        if st is not None and named is not None:
            st = (named[0], st[1])
        if st is not None:
            try:
                checked_header(data)  # (the digest only: the sender named its file in the label)
            except (SnapshotRefused, ValueError) as err:  # no file of it, whole or staged; raised once the rest is in
                mapped.discard(snap._maps, src, st[1])
                refused.append(err)
                continue
            snap._written.keep(src, mapped.publish(snap._maps, src, st[1], data, body, snap.folder / st[0]))
            continue
        header, _ = read_header(data)
        name = folders.file_name(int(header["step"]), str(header["lineage"]), int(header["owner"]))
        view = host_bytes(body) if body is not None else memoryview(b"")
        snap._written.keep(src, folders.write(snap.folder, name, data, view, snap._written.spare(src)))
    clock.lap("peer_write_s")
    for failed in (done.failed, into.failed, refused):  # (never committed: this rank does not say its copies landed)
        if failed:
            raise failed[0]


def _hints(snap: Any, step: int | None) -> dict[int, bytes]:
    """By source, the label its preamble should carry (the file of ``step`` it owns, as long as its last copy):
    with the lengths of the last exchange agreed, its parts are posted - its file staged - before it is in."""
    if step is None:
        return {}
    out = {}
    for src, lengths in snap._agreed.expected.items():
        if len(lengths) == 2 and lengths[1] >= 0:
            out[src] = label(folders.file_name(step, snap.lineage, src), lengths[1])
    return out


class _Into:
    """Where a source's parts are received (:data:`..comm.snapshot_exchange.Place`, asked on its transfer thread as
    soon as the preamble is in): its head into a fresh buffer, its file staged from the label (:func:`_stage`);
    its bytes into that file, or, unstaged (no label), a buffer kept for that source."""

    def __init__(self, snap: Any) -> None:
        self.snap, self.staged = snap, dict[int, tuple[str, mapped.Staged] | None]()
        self.failed: list[Exception] = []
        self._lock, self._closed = threading.Lock(), False

    def place(self, src: int, note: bytes, index: int, n: int) -> torch.Tensor | None:
        with self._lock:
            if self._closed:
                return None
            if index == 0:  # the head (n bytes): a fresh buffer; the file staged for the bytes that follow
                old = self.staged.get(src)
                if old is not None:  # (staged as expected, then its lengths changed: anew)
                    mapped.discard(self.snap._maps, src, old[1])
                try:
                    self.staged[src] = _stage(self.snap, src, note, n)
                except Exception as err:  # (a mapping that fails: the bytes still come, into a buffer; raised after)
                    self.failed.append(err)
                    self.staged[src] = None
                return None
            st = self.staged.get(src)
            if st is not None:
                return st[1].payload
            kept = self.snap._received.get(src)
            if kept is None or kept.numel() < n:
                kept = self.snap._received[src] = torch.empty(n, dtype=torch.uint8)
            return kept

    def close(self) -> dict[int, tuple[str, mapped.Staged] | None]:
        with self._lock:
            self._closed = True
            return dict(self.staged)


def _stage(snap: Any, src: int, note: bytes, room: int) -> tuple[str, mapped.Staged] | None:
    """The file a source's copy is received into (its name, and the file under its dot-name mapped, ``room``
    bytes for its head), or None: no label (the header is then read when it is in), or a dropped pipeline."""
    labelled = _labelled(note)
    if labelled is None or snap.dropped:
        return None
    name, total = labelled
    return name, snap._maps.stage(src, snap.folder, name, snap._written.spare(src), room, total)


def label(name: str, total: int) -> bytes:
    """What a copy's preamble carries (:func:`send`'s ``label``): its file's name and payload length, one ASCII
    line, from which the receiver stages the file before its head is in and without parsing the header's JSON
    (~50 KB for a small GPT; its digest is checked when it is in, and every reader checks it and parses it
    again)."""
    return f"{name} {total}\n".encode()


def _labelled(note: bytes) -> tuple[str, int] | None:
    """A preamble's label read back (None: none sent, or one that does not read as :func:`label` writes)."""
    line = note.rstrip(b"\n").decode("ascii", "replace")
    name, _, total = line.partition(" ")
    if not folders.is_file_name(name) or not total.isdigit():
        return None
    return name, int(total)


def commit(snap: Any, step: int, clock: idle.Clock) -> None:
    """Step ``step`` committed (module doc): ``snap.committed`` moves to it once every rank's copies landed.
    Called after :func:`send` returned (this rank's sources' copies are written here); raises if the
    all-reduce fails or is given up (nothing committed)."""
    if snap.dropped:
        return  # (its copies were not written: it must not say they were)
    if snap.world > 1:
        wire: dict[str, Any] = {"give_up": _give_up(snap), "around": snap.priority.peer_thread}
        if snapshot_wire.lowest(step, snap.group, snap.timeout, **wire) < step:
            return  # (a rank at an older snapshot: not this step)
    snap.committed = max(snap.committed, step)
    clock.lap("commit_s")


def _give_up(snap: Any) -> Any:
    return lambda: bool(snap.dropped) or heartbeat.failure_posted()


_LOST_EVERY_S = 0.5  # how often the store's stamps are read while a copy waits on a begun peer


def _lost(snap: Any) -> Any:
    """``lost(group rank)`` for :func:`..comm.snapshot_exchange.exchange_parts`: the peer is known lost
    (:func:`..comm.faults.heartbeat.lost_ranks`: its stamps stood still ``InPlace(silence_s=)``, the evidence
    that posted a stopped machine's failure, or its port refuses), read at most every :data:`_LOST_EVERY_S`."""
    seen: dict[str, Any] = {"at": -float("inf"), "ranks": set()}

    def lost(peer: int) -> bool:
        now = time.monotonic()
        if now - seen["at"] >= _LOST_EVERY_S:
            seen["at"], seen["ranks"] = now, heartbeat.lost_ranks()
        if not seen["ranks"]:
            return False
        if "global" not in seen:
            seen["global"] = groups.global_ranks(snap.group)  # (group rank -> global rank)
        return seen["global"][peer] in seen["ranks"]

    return lost
