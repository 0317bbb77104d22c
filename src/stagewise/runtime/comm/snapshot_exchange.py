"""A snapshot copy's exchange (:mod:`.snapshot_wire`'s group): parts sent to one rank, as many received from others.

Every exchange sends one preamble first (every part's length, -1 for nothing to send, how the parts follow, and
a short note), then every part's bytes; every wait has a deadline, so a peer that is gone costs the timeout at
most, and raises - or less, when the run's failure is posted first and the peer never began its part.

Why it is shaped so: a gloo send moves only once its receive is posted, and the threads that post them (and
gloo's own, :mod:`stagewise.runtime.elastic.idle`) run in a core's idle time, so every message that must wait
for the one before costs a round of the two ranks' idle moments. A length before each part made four such rounds
per copy (45-52 ms of a 61 ms step for 0.5 ms of CPU, 2026-12-04); one preamble made two: the receiver's
thread woke once the preamble was in to post the parts (33 ms of the copy's 53 on 2026-12-05). Now the sender
posts everything at once, and the receiver does too from the second exchange with a peer on (:class:`Agreed`):
a snapshot's head is padded to a room kept from generation to generation and its payload's length changes only
with the state's layout, so the lengths are those of the last exchange, and the copy takes one round. When a
length changed, the sender gives each part the receiver posted one byte and the real parts after it, and the
preamble says so (:data:`FILLED`): the receiver posts those once it is in (two rounds, as before).
"""

from __future__ import annotations

import struct
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..errors import PipelineError

_NOTHING = -1  # a part's length in the preamble when there is nothing to send
#: the longest note a preamble carries (a snapshot file's name and length, :mod:`..elastic.snapshot_copies`)
NOTE_BYTES = 512
_POLL_S = 0.1  # how often a waiting exchange asks whether to give up
#: how the parts follow the preamble: the receiver posts them once it is in; they are the lengths it posted
#: before (:class:`Agreed`); its posted parts get one byte each, and the parts follow
AFTER, AS_POSTED, FILLED = 0, 1, 2


@dataclass
class Agreed:
    """The parts' lengths of the last exchange with each peer that ended whole on this side: a receiver posts
    parts of those lengths with the preamble, and the sender knows it did. One per group, kept by the caller
    from exchange to exchange: an exchange that fails fails the run, whose next generation makes a new group
    (and a new one of these); two sides that disagree all the same are refused, saying so."""

    sent: dict[int, list[int]] = field(default_factory=dict)  # by dest
    expected: dict[int, list[int]] = field(default_factory=dict)  # by source


def exchange(
    payload: torch.Tensor | None,
    dest: int | None,
    sources: Sequence[int],
    group: Any,
    timeout: float,
    into: dict[int, torch.Tensor] | None = None,
    give_up: Callable[[], bool] | None = None,
    around: Callable[[], AbstractContextManager[Any]] | None = None,
    lost: Callable[[int], bool] | None = None,
) -> dict[int, torch.Tensor | None]:
    """:func:`exchange_settled`, its first failure raised."""
    done = exchange_settled(payload, dest, sources, group, timeout, into, give_up, around, lost=lost)
    if done.failed:
        raise done.failed[0]
    return {s: done.got.get(s) for s in sources}


@dataclass
class Settled:
    """An exchange's end: what each source whose transfer ended sent, part by part (None: it had nothing), and the
    note its preamble carried; the failures; and the peers (sources and dest) whose transfer ended without one."""

    parts: dict[int, list[torch.Tensor | None]]
    failed: list[PipelineError]
    ended: set[int]
    notes: dict[int, bytes] = field(default_factory=dict)

    @property
    def got(self) -> dict[int, torch.Tensor | None]:
        """Each source's first part (:func:`exchange_settled`'s one)."""
        return {s: p[0] if p else None for s, p in self.parts.items()}


#: ``place(source, its note, the part's index, its length)``: the buffer that part is received into (None, or one
#: too short: a fresh one), asked on that source's transfer thread, part by part, once the preamble is in - or,
#: with the lengths :class:`Agreed`, before it, with the note the caller expects (``hints``)
Place = Callable[[int, bytes, int, int], torch.Tensor | None]


def exchange_settled(
    payload: torch.Tensor | None,
    dest: int | None,
    sources: Sequence[int],
    group: Any,
    timeout: float,
    into: dict[int, torch.Tensor] | None = None,
    give_up: Callable[[], bool] | None = None,
    around: Callable[[], AbstractContextManager[Any]] | None = None,
    lost: Callable[[int], bool] | None = None,
) -> Settled:
    """:func:`exchange_parts` of one part, ``payload``; ``into``: by source, a buffer to receive into, kept
    from call to call (a new one's pages cost as much as the bytes' copy)."""
    keep: dict[int, torch.Tensor] = {} if into is None else into
    return exchange_parts([payload], dest, sources, group, timeout, _keeping(keep), give_up, around, lost=lost)


def exchange_parts(
    parts: Sequence[torch.Tensor | None],
    dest: int | None,
    sources: Sequence[int],
    group: Any,
    timeout: float,
    place: Place | None = None,
    give_up: Callable[[], bool] | None = None,
    around: Callable[[], AbstractContextManager[Any]] | None = None,
    lost: Callable[[int], bool] | None = None,
    note: bytes = b"",
    agreed: Agreed | None = None,
    hints: dict[int, bytes] | None = None,
) -> Settled:
    """Send ``parts`` (each uint8, host, or None) to group rank ``dest`` while receiving as many from each of
    ``sources``; per peer the preamble (every part's length and ``note``, at most :data:`NOTE_BYTES`) and every
    part posted at once, received where ``place`` says (a snapshot's file staged from the note, its name and
    length, and its bytes received straight into the file's pages). ``agreed`` (module doc): the lengths of the
    last exchange with each peer, updated here; ``hints``: by source, the note its preamble is expected to carry,
    ``place``'s for the parts posted before it is in.

    Each peer's transfer runs on a thread of its own (``around()``: the context each runs in), so that no peer
    waits behind another: a source that is gone does not stop the copy to ``dest`` (otherwise the survivor
    after a lost machine in the ring gives up at once, and the one after it waits the whole timeout for bytes
    that never come - and its recovery with it). The ``timeout`` bounds the whole exchange.

    ``give_up()`` (asked while waiting): once true, a transfer whose preamble has not gone through is
    abandoned - its peer never entered this exchange (its step failed before its snapshot) and never will, and
    waiting for it would hold a recovery for the whole timeout. A transfer whose preamble went through is
    waited for: its bytes come (a live peer) or fail at once (a dead one), and they may be the only copy of a
    committed snapshot - unless ``lost(peer)`` (asked only once ``give_up()`` is true) says that peer is known
    lost: a stopped machine's kernel takes in the preamble and then nothing more, and its bytes could only come
    after it was fenced out of the run (the wait would hold the recovery to the timeout: 7 of a SIGSTOP's
    10.5 s in the chaos of 2026-12-04). An abandoned transfer's thread still honours a preamble that comes late
    (fresh buffers, the bytes thrown away, ``place`` not asked again), so the peer's sends are matched and
    nothing is left for it to wait for."""
    if len(note) > NOTE_BYTES:
        raise ValueError(f"an exchange's note is at most {NOTE_BYTES} bytes, got {len(note)}")
    x = _Exchange(time.monotonic() + timeout, group, around, agreed)
    peers = [_Transfer(s, False) for s in sources] + ([_Transfer(dest, True)] if dest is not None else [])
    for t in peers:
        run = x.send if t.send else x.recv
        arg: Any = (list(parts), note) if t.send else (len(parts), place, (hints or {}).get(t.peer, b""))
        threading.Thread(target=run, args=(t, arg), name="stagewise-snapshot-peer", daemon=True).start()
    x.settle(peers, give_up, lost)
    return x.result(peers, timeout)


def _keeping(keep: dict[int, torch.Tensor]) -> Place:
    """A :data:`Place` receiving each source's parts into its buffer in ``keep`` (made, or grown, as needed)."""
    return lambda source, note, index, n: _buffer(keep, source, n)


def lengths_of(parts: Sequence[torch.Tensor | None]) -> list[int]:
    """Each part's length in a preamble (:data:`_NOTHING` for None)."""
    return [_NOTHING if p is None else p.numel() for p in parts]


def preamble(parts: Sequence[torch.Tensor | None], note: bytes, form: int = AFTER) -> torch.Tensor:
    """Every part's length (int64, little-endian like a snapshot file's numbers, whatever the machines' order;
    :data:`_NOTHING` for None), how the parts follow (``form``), the note's length, then the note, padded to
    :data:`NOTE_BYTES`: one fixed size for a count of parts, so the receiver posts it before knowing more."""
    words = [*lengths_of(parts), form, len(note)]
    data = struct.pack(f"<{len(words)}q", *words) + note.ljust(NOTE_BYTES, b"\0")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def preamble_size(count: int) -> int:
    """The bytes of :func:`preamble` for ``count`` parts."""
    return 8 * (count + 2) + NOTE_BYTES


def read_preamble(data: torch.Tensor, count: int) -> tuple[list[int], bytes, int]:
    """:func:`preamble` read back: the parts' lengths, the note and the form."""
    words = struct.unpack(f"<{count + 2}q", data[: 8 * (count + 2)].numpy().tobytes())
    form, size = int(words[count]), int(words[count + 1])
    if not 0 <= size <= NOTE_BYTES:
        raise PipelineError(f"the snapshots' copy: a preamble whose note is {size} bytes (at most {NOTE_BYTES})")
    if form not in (AFTER, AS_POSTED, FILLED):
        raise PipelineError(f"the snapshots' copy: a preamble of an unknown form ({form})")
    start = 8 * (count + 2)
    return [int(n) for n in words[:count]], data[start : start + size].numpy().tobytes(), form


@dataclass(eq=False)
class _Transfer:
    """One peer's part of an exchange: ``started`` once its preamble went through (the peer is in the exchange)."""

    peer: int
    send: bool
    started: bool = False
    abandoned: bool = False
    done: bool = False
    got: list[torch.Tensor | None] = field(default_factory=list)
    note: bytes = b""
    failure: PipelineError | None = None


class _Exchange:
    """The transfers of one exchange and the condition their threads report on."""

    def __init__(
        self, end: float, group: Any, around: Callable[[], AbstractContextManager[Any]] | None, agreed: Agreed | None
    ) -> None:
        self.end, self.group, self.around, self.agreed = end, group, around or nullcontext, agreed
        self.cv = threading.Condition()

    def settle(
        self, peers: list[_Transfer], give_up: Callable[[], bool] | None, lost: Callable[[int], bool] | None
    ) -> None:
        """Wait until every transfer ended, or was abandoned (``give_up``; begun, and its peer ``lost``), or the
        time is up."""
        quitting = give_up is not None and give_up()
        while True:
            with self.cv:
                begun = [t for t in peers if t.started and not (t.done or t.abandoned)]
            gone = {t.peer for t in begun if lost(t.peer)} if quitting and lost is not None else set()
            with self.cv:
                if quitting:
                    for t in peers:
                        t.abandoned = t.abandoned or not (t.started or t.done) or (t.peer in gone and not t.done)
                waiting = [t for t in peers if not (t.done or t.abandoned)]
                left = self.end - time.monotonic()
                if not waiting or left <= 0:
                    return
                self.cv.wait(min(left, _POLL_S))
            quitting = quitting or (give_up is not None and give_up())

    def result(self, peers: list[_Transfer], timeout: float) -> Settled:
        """What the settled ``peers`` got, and their failures (an abandoned or unfinished transfer is one)."""
        done = Settled({}, [], set())
        with self.cv:
            for t in peers:
                if t.failure is not None:
                    done.failed.append(t.failure)
                elif t.abandoned:
                    why = "stopped or was cut off in" if t.started else "never began its part of"
                    done.failed.append(
                        PipelineError(f"group rank {t.peer} {why} the snapshots' copy: given up, the run failed")
                    )
                elif not t.done:
                    done.failed.append(
                        PipelineError(f"the snapshots' copy with group rank {t.peer} did not end within {timeout:g} s")
                    )
                else:
                    done.ended.add(t.peer)
                    if not t.send:
                        done.parts[t.peer], done.notes[t.peer] = t.got, t.note
        return done

    def recv(self, t: _Transfer, arg: tuple[int, Place | None, bytes]) -> None:
        count, place, hint = arg
        expected = self.agreed.expected.pop(t.peer, None) if self.agreed is not None else None  # (back if whole)
        with self.around():
            try:
                pre = torch.empty(preamble_size(count), dtype=torch.uint8)
                first = dist.irecv(pre, group_src=t.peer, group=self.group)
                early = self._post(t.peer, expected or [], place, hint)  # (module doc: one round)
                self._wait(first, "the snapshots' copies' lengths")
                with self.cv:
                    late = t.abandoned  # (honoured: the peer's bytes follow; not kept)
                    t.started = not late
                    self.cv.notify_all()
                lengths, t.note, form = read_preamble(pre, count)
                _check_form(t.peer, form, expected, lengths)
                if form == AS_POSTED:
                    posted = early
                else:
                    for _, work in early:  # (FILLED: one byte each, thrown away)
                        self._wait(work, "the snapshots' copies")
                    posted = self._post(t.peer, lengths, None if late else place, t.note)
                for _, work in posted:
                    self._wait(work, "the snapshots' copies")
                bufs = iter(b for b, _ in posted)
                t.got = [next(bufs) if n > 0 else None for n in lengths]
                if self.agreed is not None:
                    self.agreed.expected[t.peer] = lengths
            except Exception as err:  # (posting on a closed pair raises too: never an ended transfer)
                t.failure = failure_of(err, "the snapshots' copies")
            finally:
                self._done(t)

    def _post(self, peer: int, lengths: list[int], place: Place | None, note: bytes) -> list[tuple[torch.Tensor, Any]]:
        """Every part of ``lengths`` posted at once (module doc), in the sender's order, where ``place`` says."""
        posted: list[tuple[torch.Tensor, Any]] = []
        for i, n in enumerate(lengths):
            if n <= 0:
                continue
            buf = None if place is None else place(peer, note, i, n)
            buf = torch.empty(n, dtype=torch.uint8) if buf is None or buf.numel() < n else buf[:n]
            posted.append((buf, dist.irecv(buf, group_src=peer, group=self.group)))
        return posted

    def send(self, t: _Transfer, arg: tuple[list[torch.Tensor | None], bytes]) -> None:
        parts, note = arg
        lengths = lengths_of(parts)
        posted = self.agreed.sent.pop(t.peer, None) if self.agreed is not None else None  # (back if whole)
        form = AFTER if posted is None else AS_POSTED if posted == lengths else FILLED
        with self.around():
            try:
                first = dist.isend(preamble(parts, note, form), group_dst=t.peer, group=self.group)
                filler = [torch.zeros(1, dtype=torch.uint8) for n in (posted or []) if n > 0 and form == FILLED]
                sent = [p for p in parts if p is not None and p.numel()]
                # every part at once, behind the preamble (module doc)
                rest = [dist.isend(p, group_dst=t.peer, group=self.group) for p in filler + sent]
                self._wait(first, "the snapshots' copies' lengths")
                with self.cv:
                    t.started = not t.abandoned
                    self.cv.notify_all()
                for work in rest:
                    self._wait(work, "the snapshots' copies")
                if self.agreed is not None:
                    self.agreed.sent[t.peer] = lengths
            except Exception as err:  # (posting on a closed pair raises too: never an ended transfer)
                t.failure = failure_of(err, "the snapshots' copies")
            finally:
                self._done(t)

    def _wait(self, work: Any, what: str) -> None:
        try:
            work.wait(timedelta(seconds=max(self.end - time.monotonic(), 0.001)))
        except Exception as err:
            raise PipelineError(f"waiting for {what}: {type(err).__name__}: {err}") from err

    def _done(self, t: _Transfer) -> None:
        with self.cv:
            t.done = True
            self.cv.notify_all()


def _check_form(peer: int, form: int, expected: list[int] | None, lengths: list[int]) -> None:
    """The sender's form against what this side posted (:class:`Agreed`); a disagreement is refused before any
    part is taken for another (the two sides' streams are then out of step: the run fails)."""
    if (form == AFTER) != (expected is None):
        mine = "posted its parts with the preamble" if expected is not None else "posts its parts after the preamble"
        raise PipelineError(
            f"the snapshots' copy from group rank {peer} is out of step: it sent its parts as "
            f"{'if nothing were posted' if form == AFTER else 'posted before'}, and this rank {mine}"
        )
    if form == AS_POSTED and lengths != expected:
        raise PipelineError(
            f"the snapshots' copy from group rank {peer}: its parts' lengths {lengths} are not the ones posted "
            f"({expected}), yet it sent them as posted"
        )


def failure_of(err: Exception, what: str) -> PipelineError:
    """``err`` as a :class:`PipelineError` saying what was waited for (itself if it is one)."""
    if isinstance(err, PipelineError):
        return err
    out = PipelineError(f"waiting for {what}: {type(err).__name__}: {err}")
    out.__cause__ = err
    return out


def _buffer(keep: dict[int, torch.Tensor], source: int, size: int) -> torch.Tensor:
    if source not in keep or keep[source].numel() < size:
        keep[source] = torch.empty(size, dtype=torch.uint8)
    return keep[source][:size]
