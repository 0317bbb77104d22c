"""The snapshots' traffic (:mod:`stagewise.runtime.elastic`): a gloo group of its own, and bytes between two ranks.

The copies to the peers run on a helper thread while the pipeline trains, so they get their own process
group (gloo, host memory: on GPUs too the copy is taken to the host first), never the pipeline's. Every
exchange sends one preamble first (every part's length, -1 for nothing to send, and a short note), then every
part's bytes, all posted at once; every wait has a deadline, so a peer that is gone costs the timeout at most,
and raises - or less, when the run's failure is posted first and the peer never began its part
(:func:`exchange_parts`).

Why one preamble: a gloo send moves only once its receive is posted, and the threads that post them (and
gloo's own, :mod:`stagewise.runtime.elastic.idle`) run in a core's idle time, so every message that must
wait for the one before costs a round of the two ranks' idle moments. A length before each part made four
such rounds per copy (45-52 ms of a 61 ms step for 0.5 ms of CPU, 2026-12-04); the preamble makes two.
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
from . import groups
from .collectives import gather_json

#: a side exchange's deadline may not outlast the pipeline's own (seconds)
_NOTHING = -1
#: the longest note a preamble carries (a snapshot file's name and length, :mod:`..elastic.snapshot_copies`)
NOTE_BYTES = 512
_POLL_S = 0.1  # how often a waiting exchange asks whether to give up


def snapshot_group(group: Any, timeout: float) -> Any:
    """A gloo group of ``group``'s ranks (None: the world). ``dist.new_group`` is called by every process of the
    world, in one order (a group made by its members alone is named by a count each process keeps, which other
    groups made that way can put out of step): when the pipeline is not the whole world, every rank's pipeline
    group is gathered first and each made in turn, as every rank builds its pipeline at the same time."""
    mine = tuple(groups.global_ranks(group))
    ready = groups.take_gloo(mine)  # made ahead by a re-layout onto fewer processes (relayout/call.py)
    if ready is not None:
        return ready
    delta = timedelta(seconds=timeout)
    if len(mine) == groups.world_size():
        return dist.new_group(list(mine), backend="gloo", timeout=delta)
    everyone = gather_json(list(mine), None, _deadline(timeout), "every rank's pipeline group (snapshot=)")
    found = None
    for ranks in sorted({tuple(r) for r in everyone}):
        made = dist.new_group(list(ranks), backend="gloo", timeout=delta)
        if ranks == mine:
            found = made
    return found


def gather(obj: Any, group: Any, timeout: float, what: str) -> list[Any]:
    """Every rank's JSON-like ``obj`` over ``group``, in group-rank order, within ``timeout`` seconds."""
    return gather_json(obj, group, _deadline(timeout), what)


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
    """An exchange's end: what each source whose transfer ended sent, part by part (None: it had nothing), the
    failures, and the peers (sources and dest) whose transfer ended without one."""

    parts: dict[int, list[torch.Tensor | None]]
    failed: list[PipelineError]
    ended: set[int]

    @property
    def got(self) -> dict[int, torch.Tensor | None]:
        """Each source's first part (:func:`exchange_settled`'s one)."""
        return {s: p[0] if p else None for s, p in self.parts.items()}


#: ``place(source, its note, the part's index, its length)``: the buffer that part is received into (None, or one
#: too short: a fresh one), asked on that source's transfer thread, part by part, as soon as the preamble is in
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
) -> Settled:
    """Send ``parts`` (each uint8, host, or None) to group rank ``dest`` while receiving as many from each of
    ``sources``; per peer its preamble first (every part's length and ``note``, at most :data:`NOTE_BYTES`),
    then every part at once, received where ``place`` says (a snapshot's file staged from the note, its name
    and length, and its bytes received straight into the file's pages: one exchange, not one per part, so no
    peer's bytes wait for every peer's head - on a rank with no spare core each exchange waits for the peers'
    idle time, and a second one made the copy outlast the step).

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
    (fresh buffers, the bytes thrown away, ``place`` not asked), so the peer's sends are matched and nothing is
    left for it to wait for."""
    if len(note) > NOTE_BYTES:
        raise ValueError(f"an exchange's note is at most {NOTE_BYTES} bytes, got {len(note)}")
    x = _Exchange(time.monotonic() + timeout, group, around)
    peers = [_Transfer(s, False) for s in sources] + ([_Transfer(dest, True)] if dest is not None else [])
    for t in peers:
        run = x.send if t.send else x.recv
        arg: Any = (list(parts), note) if t.send else (len(parts), place)
        threading.Thread(target=run, args=(t, arg), name="stagewise-snapshot-peer", daemon=True).start()
    x.settle(peers, give_up, lost)
    return x.result(peers, timeout)


def _keeping(keep: dict[int, torch.Tensor]) -> Place:
    """A :data:`Place` receiving each source's parts into its buffer in ``keep`` (made, or grown, as needed)."""
    return lambda source, note, index, n: _buffer(keep, source, n)


def preamble(parts: Sequence[torch.Tensor | None], note: bytes) -> torch.Tensor:
    """Every part's length (int64, little-endian like a snapshot file's numbers, whatever the machines' order;
    :data:`_NOTHING` for None), the note's length, then the note, padded to :data:`NOTE_BYTES`: one fixed size
    for a count of parts, so the receiver posts it before knowing more."""
    lengths = [_NOTHING if p is None else p.numel() for p in parts] + [len(note)]
    data = struct.pack(f"<{len(lengths)}q", *lengths) + note.ljust(NOTE_BYTES, b"\0")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def read_preamble(data: torch.Tensor, count: int) -> tuple[list[int], bytes]:
    """:func:`preamble` read back: the parts' lengths and the note."""
    words = struct.unpack(f"<{count + 1}q", data[: 8 * (count + 1)].numpy().tobytes())
    size = int(words[count])
    if not 0 <= size <= NOTE_BYTES:
        raise PipelineError(f"the snapshots' copy: a preamble whose note is {size} bytes (at most {NOTE_BYTES})")
    start = 8 * (count + 1)
    return [int(n) for n in words[:count]], data[start : start + size].numpy().tobytes()


@dataclass(eq=False)
class _Transfer:
    """One peer's part of an exchange: ``started`` once its preamble went through (the peer is in the exchange)."""

    peer: int
    send: bool
    started: bool = False
    abandoned: bool = False
    done: bool = False
    got: list[torch.Tensor | None] = field(default_factory=list)
    failure: PipelineError | None = None


class _Exchange:
    """The transfers of one exchange and the condition their threads report on."""

    def __init__(self, end: float, group: Any, around: Callable[[], AbstractContextManager[Any]] | None) -> None:
        self.end, self.group, self.around = end, group, around or nullcontext
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
        got, failed = done.parts, done.failed
        with self.cv:
            for t in peers:
                if t.failure is not None:
                    failed.append(t.failure)
                elif t.abandoned:
                    why = "stopped or was cut off in" if t.started else "never began its part of"
                    failed.append(
                        PipelineError(f"group rank {t.peer} {why} the snapshots' copy: given up, the run failed")
                    )
                elif not t.done:
                    failed.append(
                        PipelineError(f"the snapshots' copy with group rank {t.peer} did not end within {timeout:g} s")
                    )
                else:
                    done.ended.add(t.peer)
                    if not t.send:
                        got[t.peer] = t.got
        return done

    def recv(self, t: _Transfer, arg: tuple[int, Place | None]) -> None:
        count, place = arg
        with self.around():
            try:
                pre = torch.empty(8 * (count + 1) + NOTE_BYTES, dtype=torch.uint8)
                self._wait(dist.irecv(pre, group_src=t.peer, group=self.group), "the snapshots' copies' lengths")
                with self.cv:
                    late = t.abandoned  # (honoured: the peer's bytes follow; not kept)
                    t.started = not late
                    self.cv.notify_all()
                lengths, note = read_preamble(pre, count)
                posted: list[tuple[torch.Tensor, Any]] = []
                for i, n in enumerate(lengths):  # every part posted at once (module doc), in the sender's order
                    if n <= 0:
                        continue
                    buf = None if late or place is None else place(t.peer, note, i, n)
                    buf = torch.empty(n, dtype=torch.uint8) if buf is None or buf.numel() < n else buf[:n]
                    posted.append((buf, dist.irecv(buf, group_src=t.peer, group=self.group)))
                for _, work in posted:
                    self._wait(work, "the snapshots' copies")
                bufs = iter(b for b, _ in posted)
                t.got = [next(bufs) if n > 0 else None for n in lengths]
            except Exception as err:  # (posting on a closed pair raises too: never an ended transfer)
                t.failure = _failure(err, "the snapshots' copies")
            finally:
                self._done(t)

    def send(self, t: _Transfer, arg: tuple[list[torch.Tensor | None], bytes]) -> None:
        parts, note = arg
        with self.around():
            try:
                first = dist.isend(preamble(parts, note), group_dst=t.peer, group=self.group)
                self._wait(first, "the snapshots' copies' lengths")
                with self.cv:
                    t.started = not t.abandoned
                    self.cv.notify_all()
                # every part at once: the receiver posts them all as soon as the preamble is in (module doc)
                rest = [dist.isend(p, group_dst=t.peer, group=self.group) for p in parts if p is not None and p.numel()]
                for work in rest:
                    self._wait(work, "the snapshots' copies")
            except Exception as err:  # (posting on a closed pair raises too: never an ended transfer)
                t.failure = _failure(err, "the snapshots' copies")
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


def lowest(
    value: int,
    group: Any,
    timeout: float,
    give_up: Callable[[], bool] | None = None,
    around: Callable[[], AbstractContextManager[Any]] | None = None,
) -> int:
    """The lowest of every group rank's ``value`` (an all-reduce), or a :class:`PipelineError` when it failed,
    did not end within ``timeout`` seconds, or ``give_up()`` turned true first. The all-reduce runs on a thread
    of its own (``around()``: its context), so a peer that never joins holds the caller only until the run's
    failure is posted (gloo cannot cancel it: the abandoned thread ends at the timeout)."""
    out = torch.tensor([value], dtype=torch.int64)
    box: dict[str, PipelineError] = {}
    ended = threading.Event()

    def run() -> None:
        with (around or nullcontext)():
            try:
                work = dist.all_reduce(out, op=dist.ReduceOp.MIN, group=group, async_op=True)
                work.wait(timedelta(seconds=timeout))
            except Exception as err:
                box["failed"] = _failure(err, "the snapshots' commit")
            finally:
                ended.set()

    threading.Thread(target=run, name="stagewise-snapshot-commit", daemon=True).start()
    end = time.monotonic() + timeout
    while not ended.wait(min(_POLL_S, max(end - time.monotonic(), 0.0))):
        if give_up is not None and give_up():
            raise PipelineError("the snapshots' commit: given up, the run failed")
        if time.monotonic() >= end:
            raise PipelineError(f"the snapshots' commit did not end within {timeout:g} s")
    if "failed" in box:
        raise box["failed"]
    return int(out.item())


def _failure(err: Exception, what: str) -> PipelineError:
    if isinstance(err, PipelineError):
        return err
    out = PipelineError(f"waiting for {what}: {type(err).__name__}: {err}")
    out.__cause__ = err
    return out


def _buffer(keep: dict[int, torch.Tensor], source: int, size: int) -> torch.Tensor:
    if source not in keep or keep[source].numel() < size:
        keep[source] = torch.empty(size, dtype=torch.uint8)
    return keep[source][:size]


def send_bytes(data: torch.Tensor | None, dest: int, group: Any, timeout: float) -> None:
    """Send ``data`` (uint8, host; None: nothing) to group rank ``dest``: its length, then its bytes."""
    wait = _deadline(timeout)
    length = torch.tensor([_NOTHING if data is None else data.numel()], dtype=torch.int64)
    wait([dist.isend(length, group_dst=dest, group=group)], f"sending a snapshot's length to group rank {dest}")
    if data is not None and data.numel():
        wait([dist.isend(data, group_dst=dest, group=group)], f"sending a snapshot to group rank {dest}")


def recv_bytes(src: int, group: Any, timeout: float) -> torch.Tensor | None:
    """What :func:`send_bytes` sent from group rank ``src`` (None: nothing)."""
    wait = _deadline(timeout)
    length = torch.empty(1, dtype=torch.int64)
    wait([dist.irecv(length, group_src=src, group=group)], f"a snapshot's length from group rank {src}")
    n = int(length.item())
    if n < 0:
        return None
    data = torch.empty(n, dtype=torch.uint8)
    if n:
        wait([dist.irecv(data, group_src=src, group=group)], f"a snapshot from group rank {src}")
    return data


def _deadline(timeout: float) -> Any:
    """``wait(works, what)`` giving up after ``timeout`` seconds in all, with a :class:`PipelineError`."""
    delta = timedelta(seconds=timeout)

    def wait(works: Sequence[Any], what: str) -> None:
        for w in works:
            try:
                w.wait(delta)
            except Exception as err:
                raise PipelineError(f"waiting for {what}: {type(err).__name__}: {err}") from err

    return wait
