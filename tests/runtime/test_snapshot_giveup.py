"""A failed generation's snapshot copy gives up on a peer that never began (issue 48 item 4, the kill's p95).

A survivor whose step failed before its snapshot never enters that snapshot's exchange; the rank it sends
to waited for its length until the exchange's timeout, and the recovery's drop (which finishes the copy in
flight) waited with it. The fake wire below has such a peer: its length never comes until the test lets
its wait end, so a drop that waited for it could not return before that; no clock is read."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers.fake_wire import Blocked, Done, install
from stagewise.runtime.comm import snapshot_exchange, snapshot_wire
from stagewise.runtime.comm.faults import heartbeat
from stagewise.runtime.comm.snapshot_exchange import AFTER, AS_POSTED
from stagewise.runtime.elastic import folder as folders
from stagewise.runtime.elastic import idle, mapped, snapshot_copies
from stagewise.runtime.elastic.peers import Peers
from stagewise.runtime.elastic.snapshot_file import fill_payload, header_bytes, layout_payload, read_header
from stagewise.runtime.errors import PipelineError


class _Wire:
    """snapshot_wire's point-to-point ops, faked: ``silent`` never begins (its waits block until ``release``);
    every other source sends ``heads[src]`` then ``bodies[src]``; sends complete."""

    def __init__(self, silent: int, heads: dict[int, bytes], bodies: dict[int, bytes], sends: int, form: int) -> None:
        self.sends, self.form = sends, form  # the sends after which ``sent`` is set; the sources' preambles' form
        self.silent, self.release, self.lock = silent, threading.Event(), threading.Lock()
        self.heads, self.bodies = heads, bodies
        self.labels: dict[int, bytes] = {}  # by source: a label of the test's (else one read from its head)
        self.phase: dict[int, int] = {}  # by source: 0 the preamble (both lengths), 1 the head, 2 the body
        self.posted: list[tuple[str, int]] = []
        self.blocked_ended = threading.Event()  # the silent peer's wait ended (only when the test releases it)
        self.sent = threading.Event()
        self.head_in = threading.Event()  # a source's head (length and bytes) was received
        self.body_in = threading.Event()  # a source's bytes were received

    def irecv(self, t: torch.Tensor, group_src: int, group: Any) -> Any:
        with self.lock:
            self.posted.append(("recv", group_src))
            if group_src == self.silent:
                return Blocked(self.release, self.blocked_ended)
            n = self.phase.get(group_src, 0)
            self.phase[group_src] = n + 1
            head, body = self.heads[group_src], self.bodies[group_src]
            if n == 0:
                sizes = [torch.empty(len(head), dtype=torch.uint8), torch.empty(len(body), dtype=torch.uint8)]
                note = self.labels.get(group_src) or _label(head, body)  # (named as a helper names its file)
                t.copy_(snapshot_exchange.preamble(sizes, note, self.form))
                return Done()
            (self.head_in if n == 1 else self.body_in).set()
            t.copy_(torch.frombuffer(bytearray(head if n == 1 else body), dtype=torch.uint8))
        return Done()

    def isend(self, t: torch.Tensor, group_dst: int, group: Any) -> Any:
        with self.lock:
            self.posted.append(("send", group_dst))
            if sum(1 for kind, _ in self.posted if kind == "send") == self.sends:
                self.sent.set()
        return Done()


def _label(head: bytes, body: bytes) -> bytes:
    header, _ = read_header(head)
    return snapshot_copies.label(folders.file_name(header["step"], header["lineage"], header["owner"]), len(body))


def _payload(step: int, owner: int, room: int = 0) -> tuple[bytes, bytes]:
    ts = {"model.w": torch.arange(4.0) + owner}
    entries, total = layout_payload(ts)
    buffer = torch.zeros(total, dtype=torch.uint8)
    fill_payload(buffer, ts, entries)
    head = header_bytes({"step": step, "lineage": "ab12", "owner": owner, "tensors": entries}, buffer, room)
    return head, buffer.numpy().tobytes()


@pytest.fixture
def wire(monkeypatch: pytest.MonkeyPatch) -> Any:
    made: list[_Wire] = []
    heartbeat.stop()  # (a failure another test posted in this process would read as this run's: give-ups race)

    def make(
        silent: int, heads: dict[int, bytes], bodies: dict[int, bytes], sends: int = 2, form: int = AFTER
    ) -> _Wire:
        return install(monkeypatch, _Wire(silent, heads, bodies, sends, form), made)

    yield make
    for w in made:
        w.release.set()  # the silent peer's thread ends
    heartbeat.stop()  # (the posted failure is this test's)


def test_an_exchange_gives_up_on_a_peer_that_never_began_once_the_failure_is_posted(wire: Any) -> None:
    """Rank 4 sends to rank 0 and receives from rank 2, whose step failed before its snapshot: once the run's
    failure is posted, the exchange returns - its copy to rank 0 done, rank 2 named - while rank 2's wait is
    still blocked (the timeout path was not waited for)."""
    w = wire(silent=2, heads={}, bodies={})
    posted = threading.Event()
    out: dict[str, Any] = {}

    def run() -> None:
        payload = torch.arange(3, dtype=torch.uint8)
        out["done"] = snapshot_exchange.exchange_settled(payload, 0, [2], None, 3600.0, give_up=posted.is_set)
        out["blocked_ended"] = w.blocked_ended.is_set()

    t = threading.Thread(target=run)
    t.start()
    assert w.sent.wait(60)  # the live dest got the length and the bytes
    posted.set()
    t.join(60)
    assert not t.is_alive()
    assert out["blocked_ended"] is False  # returned while rank 2's wait was still blocked
    assert out["done"].got == {} and out["done"].ended == {0}
    assert [str(e) for e in out["done"].failed] == [
        "group rank 2 never began its part of the snapshots' copy: given up, the run failed"
    ]


def test_without_the_failure_posted_the_exchange_waits_for_the_peer(wire: Any) -> None:
    """The mutant's check: nothing posted, the exchange is still waiting for rank 2 (until its wait ends)."""
    w = wire(silent=2, heads={}, bodies={})
    done = threading.Event()

    def run() -> None:
        snapshot_exchange.exchange_settled(
            torch.arange(3, dtype=torch.uint8), 0, [2], None, 3600.0, give_up=lambda: False
        )
        done.set()

    t = threading.Thread(target=run)
    t.start()
    assert w.sent.wait(60)
    assert not done.wait(0.5)  # (an event, not a bound: it must not have returned at all)
    w.release.set()
    t.join(60)
    assert done.is_set() and w.blocked_ended.is_set()


class _Snap:
    """What :func:`.snapshot_copies.deliver` reads of a snapshotter: a rank with two sources and a dest."""

    def __init__(self, root: Path) -> None:
        self.peers = Peers(["a", "b", "c"], 0, [2, 4])
        self.group, self.timeout = None, 3600.0
        self.priority = idle.Priority()
        self.folder = folders.machine_folder(root, "run")
        self._written = folders.Written(self.folder, 1)
        self._received: dict[int, torch.Tensor] = {}
        self._maps = mapped.Files()
        self._agreed, self.lineage = snapshot_exchange.Agreed(), "ab12"
        self.dropped = False
        self.stats: dict[str, float] = {}
        self.world, self.committed = 6, 0


def _send_in_thread(snap: _Snap, w: _Wire, out: dict[str, Any]) -> threading.Thread:
    own_head, own_body = _payload(7, 1)

    def run() -> None:
        clock = idle.Clock(snap.stats)
        try:  # (what the helper thread does once its own file is written)
            snapshot_copies.deliver(snap, 7, own_head, torch.frombuffer(bytearray(own_body), dtype=torch.uint8), clock)
        except PipelineError as err:
            out["err"] = str(err)
        out["blocked_ended"] = w.blocked_ended.is_set()

    t = threading.Thread(target=run)
    t.start()
    return t


def test_a_failed_generations_copy_keeps_what_arrived_whole_and_stops_at_the_posted_failure(
    wire: Any, tmp_path: Path
) -> None:
    """The recovery's path: ``heartbeat.post_failure`` (the survivor's first move) ends the wait for rank 2,
    which never began; rank 4, whose head was in, is waited for, and its copy is written before the failure is
    raised, so the folder the next generation lists holds every whole file and no half one."""
    head, body = _payload(7, 4)
    w = wire(silent=2, heads={4: head}, bodies={4: body})
    snap, out = _Snap(tmp_path), dict[str, Any]()
    t = _send_in_thread(snap, w, out)
    assert w.sent.wait(60) and w.head_in.wait(60)  # the head to rank 0, rank 4's head here
    heartbeat.post_failure("global rank 2 stopped or died")
    t.join(60)
    assert not t.is_alive() and out["blocked_ended"] is False
    assert out["err"] == "group rank 2 never began its part of the snapshots' copy: given up, the run failed"
    found, refused = folders.inventory(snap.folder)
    assert [(f.header["step"], f.header["owner"]) for f in found] == [(7, 4)] and refused == []
    assert [p.name for p in snap.folder.iterdir()] == [folders.file_name(7, "ab12", 4)]  # no .tmp left


def test_a_dropped_snapshotters_helper_writes_no_copy(wire: Any, tmp_path: Path) -> None:
    """Once dropped, the helper writes nothing more (the next generation may be listing the folder)."""
    head, body = _payload(7, 4)
    w = wire(silent=2, heads={4: head}, bodies={4: body})
    snap, out = _Snap(tmp_path), dict[str, Any]()
    t = _send_in_thread(snap, w, out)
    assert w.sent.wait(60) and w.head_in.wait(60)
    snap.dropped = True  # (what ``forget`` sets)
    t.join(60)
    assert not t.is_alive() and "never began" in out["err"]
    assert ("recv", 4) in w.posted and w.phase[4] == 3  # rank 4's bytes came in, and were not written
    assert not snap.folder.exists() or list(snap.folder.iterdir()) == []


def test_a_transfer_whose_posting_fails_is_a_failure_not_an_end(monkeypatch: pytest.MonkeyPatch) -> None:
    """gloo raises at the posting itself on a pair a timeout closed: that transfer failed (it never counts as
    ended, and no copy is written from it)."""

    def closed(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("Application timeout caused pair closure")

    monkeypatch.setattr(snapshot_wire.dist, "irecv", closed)
    monkeypatch.setattr(snapshot_wire.dist, "isend", lambda *a, **k: Done())
    done = snapshot_exchange.exchange_settled(torch.arange(3, dtype=torch.uint8), 0, [2], None, 3600.0)
    assert done.ended == {0} and done.got == {}
    assert [str(e) for e in done.failed] == [
        "waiting for the snapshots' copies: RuntimeError: Application timeout caused pair closure"
    ]


# ---- the commit point (issue 48: no committed step rolled back) ---------------------------------------------------
class _AllReduce:
    """The commit's all-reduce, faked: records what this rank said and which copies were in its folder then;
    ends (with ``lowest``) only when the test lets it - a rank whose copy never landed never joins."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.said, self.listed = folder, list[int](), list[list[str]]()
        self.release, self.lowest, self.entered = threading.Event(), 0, threading.Event()

    def __call__(self, t: torch.Tensor, op: Any, group: Any, async_op: bool) -> Any:
        self.said.append(int(t.item()))
        self.listed.append(sorted(p.name for p in self.folder.glob("*.snap")) if self.folder.exists() else [])
        self.entered.set()
        return _Work(self, t)


class _Work:
    """The fake all-reduce's work: like torch's, it holds the tensor only while it lives (no reference cycle: the
    commit waits until every reference taken during the all-reduce is let go, ``blocking.letting_go``)."""

    def __init__(self, reduce: _AllReduce, t: torch.Tensor) -> None:
        self.reduce, self.t = reduce, t

    def wait(self, timeout: Any = None) -> bool:
        self.reduce.release.wait()
        self.t.fill_(self.reduce.lowest)
        return True


@pytest.fixture
def all_reduce(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    made: list[_AllReduce] = []

    def make(folder: Path) -> _AllReduce:
        a = _AllReduce(folder)
        monkeypatch.setattr(snapshot_wire.dist, "all_reduce", a)
        made.append(a)
        return a

    yield make
    for a in made:
        a.release.set()


def test_a_step_whose_copy_never_arrives_is_not_committed(wire: Any, all_reduce: Any, tmp_path: Path) -> None:
    """Rank 2's copy never arrives here: this rank never says its copies landed (no all-reduce), and the step is
    not committed - not when the failure is posted, not after."""
    head, body = _payload(7, 4)
    w = wire(silent=2, heads={4: head}, bodies={4: body})
    snap, out = _Snap(tmp_path), dict[str, Any]()
    a = all_reduce(snap.folder)
    t = _send_in_thread(snap, w, out)
    assert w.sent.wait(60) and w.head_in.wait(60)
    assert snap.committed == 0
    heartbeat.post_failure("global rank 2 stopped or died")
    t.join(60)
    assert not t.is_alive() and "never began" in out["err"]
    assert a.said == [] and snap.committed == 0


def test_a_step_is_committed_once_every_rank_said_its_copies_landed(wire: Any, all_reduce: Any, tmp_path: Path) -> None:
    """Every copy here arrives: they are written, then this rank says so; the step is committed only once the
    all-reduce ends (every rank said so), never while another rank's copy may still be on its way."""
    heads, bodies = {}, {}
    for src in (2, 4):
        heads[src], bodies[src] = _payload(7, src)
    w = wire(silent=99, heads=heads, bodies=bodies)
    snap, out = _Snap(tmp_path), dict[str, Any]()
    a = all_reduce(snap.folder)
    a.lowest = 7
    t = _send_in_thread(snap, w, out)
    assert a.entered.wait(60)
    assert a.said == [7] and a.listed == [[folders.file_name(7, "ab12", s) for s in (2, 4)]]  # written first
    assert snap.committed == 0  # said, but not every rank has
    a.release.set()
    t.join(60)
    assert not t.is_alive() and "err" not in out
    assert snap.committed == 7


def test_a_commit_another_rank_never_joins_is_given_up_at_the_failure(
    wire: Any, all_reduce: Any, tmp_path: Path
) -> None:
    """Another rank's copy never landed (it never joins the all-reduce): once the run's failure is posted the
    helper gives up, raising, and the step stays uncommitted."""
    heads, bodies = {}, {}
    for src in (2, 4):
        heads[src], bodies[src] = _payload(7, src)
    w = wire(silent=99, heads=heads, bodies=bodies)
    snap, out = _Snap(tmp_path), dict[str, Any]()
    a = all_reduce(snap.folder)
    t = _send_in_thread(snap, w, out)
    assert a.entered.wait(60)
    heartbeat.post_failure("global rank 5 stopped or died")
    t.join(60)
    assert not t.is_alive() and out["err"] == "the snapshots' commit: given up, the run failed"
    assert snap.committed == 0 and not a.release.is_set()  # returned while the all-reduce was still blocked


def test_a_sources_copy_is_received_into_its_files_pages_and_reads_back_whole(wire: Any, tmp_path: Path) -> None:
    """Each source's bytes land in its file's mapped pages (no kept buffer), the head written at its start: every
    generation's copies read back to the bit, and the three files per source are the same pages over and over."""
    from stagewise.runtime.elastic.snapshot_file import tensors_of, verified

    snap, inodes = _Snap(tmp_path), list[int]()
    for step in (7, 8, 9, 10):
        heads, bodies = {}, {}
        for src in (2, 4):
            heads[src], bodies[src] = _payload(step, src, room=4096)  # (padded: one length from step to step)
        wire(silent=99, heads=heads, bodies=bodies, form=AFTER if step == 7 else AS_POSTED)  # (as a live peer)
        own_head, own_body = _payload(step, 1, room=4096)
        own = torch.frombuffer(bytearray(own_body), dtype=torch.uint8)
        snapshot_copies.send(snap, own_head, own, idle.Clock({}), step=step)  # (from step 8: staged from the hint)
        for src in (2, 4):
            path = snap.folder / folders.file_name(step, "ab12", src)
            back = tensors_of(*verified(path.read_bytes()))
            assert (
                torch.equal(back["model.w"], torch.arange(4.0) + src) and path.read_bytes() == heads[src] + bodies[src]
            )
            st = path.stat()
            assert (st.st_dev, st.st_ino) in snap._maps.maps[src]  # received in place: its mapping kept
        inodes.append((snap.folder / folders.file_name(step, "ab12", 4)).stat().st_ino)
    assert snap._received == {}  # nothing received into a buffer of its own
    assert inodes[3] == inodes[0] and len(set(inodes)) == 3
    assert not [p for p in snap.folder.iterdir() if p.name.endswith(".tmp")]


def test_a_sources_bytes_do_not_wait_for_another_sources_head(wire: Any, tmp_path: Path) -> None:
    """One exchange for head and bytes: rank 4's bytes are received (into its staged file) while rank 2 has not
    even sent its head's length. On a rank with no spare core every exchange waits for the peers' idle time, and
    a bytes' exchange begun only once every head was in made the copy outlast the step (issue 48's snapshot
    cost, 2026-12-04: heads 41-52 ms, then bytes 22-26 ms, of a 86 ms step)."""
    head, body = _payload(7, 4)
    w = wire(silent=2, heads={4: head}, bodies={4: body})
    snap, out = _Snap(tmp_path), dict[str, Any]()
    t = _send_in_thread(snap, w, out)
    assert w.body_in.wait(60)  # (a liveness bound: the fake's receives complete at once)
    assert w.phase.get(4) == 3 and not w.release.is_set()  # rank 4's bytes in, rank 2 still silent
    st = snap._maps.maps.get(4)
    assert st, "rank 4's bytes were not received into a staged file"
    heartbeat.post_failure("global rank 2 stopped or died")
    t.join(60)
    assert not t.is_alive() and "never began" in out["err"]
    assert [p.name for p in snap.folder.iterdir()] == [folders.file_name(7, "ab12", 4)]  # whole, and written
