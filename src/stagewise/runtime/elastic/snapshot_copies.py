"""A snapshot's copies between machines: this rank's sent to the next machine, the previous machine's written here.

The helper thread of :mod:`.snapshots` calls :func:`send` once its own file is written. What arrived whole is
written before any failure is raised, so that a copy the sender counts as delivered (a committed step's
only copy when the sender's machine is lost next) is never thrown away with the exchange that failed on
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

import time
from typing import Any

import torch

from ..comm import snapshot_wire
from ..comm.faults import heartbeat
from . import folder as folders
from . import idle
from .snapshot_file import host_bytes, read_header


def deliver(snap: Any, step: int, head: bytes, payload: torch.Tensor, clock: idle.Clock) -> None:
    """The helper's part after its own file: :func:`send`, then :func:`commit` (only if nothing failed)."""
    send(snap, head, payload, clock)
    commit(snap, step, clock)


def send(snap: Any, head: bytes, payload: torch.Tensor, clock: idle.Clock) -> None:
    """Heads, then payloads, to ``snap``'s next machine's rank (a :class:`.snapshots.Snapshotter`); the copies
    from the previous machine written here; then the first failure, if any, raised."""
    p = snap.peers
    if p.dest is None and not p.sources:
        return
    head_t = torch.frombuffer(bytearray(head), dtype=torch.uint8)
    wire: dict[str, Any] = {"give_up": _give_up(snap), "around": snap.priority.peer_thread}
    end = time.monotonic() + snap.timeout  # one deadline for both (seen: the heads given up on a source at the
    # failure, 10 s after a partition, then the bytes to the cut-off dest, whose head was in, waited 10 s more)
    heads = snapshot_wire.exchange_settled(head_t, p.dest, p.sources, snap.group, snap.timeout, **wire)
    # a peer whose head went through is in this snapshot's copy: its bytes are waited for, given up or not
    left = max(end - time.monotonic(), 0.001)
    bodies = snapshot_wire.exchange_settled(
        payload, p.dest, p.sources, snap.group, left, into=snap._received, begun=heads.ended, **wire
    )
    failed = heads.failed + bodies.failed
    clock.lap("send_s")
    for src in p.sources:
        got_head = heads.got.get(src)
        if got_head is None or src not in bodies.got or snap.dropped:
            continue  # nothing sent, or its head or bytes failed: no file (never a head without its bytes)
        body = bodies.got[src]
        data = got_head.numpy().tobytes()
        header, _ = read_header(data)
        name = folders.file_name(int(header["step"]), str(header["lineage"]), int(header["owner"]))
        view = host_bytes(body) if body is not None else memoryview(b"")
        snap._written.keep(src, folders.write(snap.folder, name, data, view, snap._written.spare(src)))
    clock.lap("peer_write_s")
    if failed:
        raise failed[0]


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
