"""One-process pieces of fault handling (issues 17, 32): plain-data metadata, the store deadline, forensics text,
private /dev/shm names, the first line of an error, the run's nonce, no pickles."""

from __future__ import annotations

import ast
import os
import stat
import threading
import time
from collections import namedtuple
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import stagewise
from stagewise.ir import Action, Kind
from stagewise.runtime.comm import coordinator
from stagewise.runtime.comm.attempt_store import elect
from stagewise.runtime.comm.coordinator import DeadlineStore
from stagewise.runtime.comm.faults import divergence, heartbeat
from stagewise.runtime.comm.faults.guard import Guard
from stagewise.runtime.comm.shm import names
from stagewise.runtime.engine.forensics import position
from stagewise.runtime.engine.messages import Meta
from stagewise.runtime.engine.tree import flatten, spec_from_plain, spec_to_plain, unflatten
from stagewise.runtime.errors import PipelineError

Pair = namedtuple("Pair", ["h", "mask"])


def test_meta_round_trips_through_json_not_pickle() -> None:
    value = (
        {"x": torch.zeros(2, 3, dtype=torch.float64), 7: [torch.ones(1, dtype=torch.int64), "tag", None, 2.5]},
        Pair(torch.zeros(4, requires_grad=True), True),
    )
    meta, leaves = Meta.of(value)
    blob = meta.to_bytes("output")
    assert blob.startswith(b"{") and b"pickle" not in blob
    back = Meta.from_bytes(blob)
    assert back == meta  # spec (namedtuple type found again), shapes, dtypes, grad flags
    rebuilt = back.rebuild([torch.empty(s, dtype=d) for s, d in zip(back.shapes, back.dtypes)])
    assert isinstance(rebuilt[1], Pair) and rebuilt[1].mask is True and rebuilt[1].h.requires_grad
    assert rebuilt[0][7][1:] == ["tag", None, 2.5]
    assert unflatten(spec_from_plain(spec_to_plain(flatten(value)[1])), leaves)[0][7][1] == "tag"


def test_a_constant_json_cannot_carry_is_named() -> None:
    _, spec = flatten({"h": torch.zeros(1), "cfg": {"dtype": torch.float32}})
    with pytest.raises(TypeError, match=r"output\['cfg'\]\['dtype'\] holds a constant of type dtype"):
        spec_to_plain(spec, "output")


def test_an_unknown_namedtuple_from_a_peer_is_refused() -> None:
    with pytest.raises(TypeError, match="not a namedtuple among this rank's loaded modules"):
        spec_from_plain(["namedtuple", "os:system", []])


class _StuckStore:
    """A store whose ``check`` never answers (a stopped host), and whose ``get`` does."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def check(self, keys: list[str]) -> bool:
        self.release.wait()
        return False

    def get(self, key: str) -> bytes:
        return b"value"


def test_a_store_call_that_never_returns_times_out_and_the_client_stays_refused() -> None:
    inner = _StuckStore()
    store = DeadlineStore(inner, timeout=0.2)
    with pytest.raises(TimeoutError, match=r"did not answer check\(\)"):
        store.check(["k"])
    with pytest.raises(TimeoutError, match="an earlier store call has not returned"):
        store.get("k")  # the helper is still stuck: no second call queues behind it
    inner.release.set()
    assert DeadlineStore(inner, timeout=5.0).get("k") == b"value"


def test_position_before_the_first_step_has_no_empty_plan() -> None:
    text = position(2, (), None, None, "the run id")
    assert text == "rank 2 before its first step, waiting for the run id"
    text = position(0, (Action(0, Kind.F, 0), Action(0, Kind.B, 0)), Action(0, Kind.B, 0), None, "")
    assert text.startswith("rank 0 at 0B0 (action 2 of 2; last completed: none)") and ">>0B0<<" in text


# ---- /dev/shm names: never through a link, never someone else's (issue 32) -------------------------------------
def test_a_shm_name_is_created_0600_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o277)  # would leave 0400
    try:
        fd, created = names.open_private(str(tmp_path / "slot"), os.O_RDWR, stat.S_IFREG)
    finally:
        os.umask(old)
    os.close(fd)
    assert created and stat.S_IMODE(os.stat(tmp_path / "slot").st_mode) == 0o600
    fd, created = names.open_private(str(tmp_path / "slot"), os.O_RDWR, stat.S_IFREG)  # the peer's open: accepted
    os.close(fd)
    assert not created


def test_a_shm_name_someone_else_made_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "elsewhere"
    target.write_bytes(b"")
    os.symlink(target, tmp_path / "link")
    with pytest.raises(PipelineError, match="is a symbolic link"):
        names.open_private(str(tmp_path / "link"), os.O_RDWR, stat.S_IFREG)
    loose = tmp_path / "loose"
    loose.write_bytes(b"")
    os.chmod(loose, 0o644)
    with pytest.raises(PipelineError, match="its mode is 0644, not 0600"):
        names.open_private(str(loose), os.O_RDWR, stat.S_IFREG)
    os.mkfifo(tmp_path / "bell", 0o600)
    with pytest.raises(PipelineError, match="it is a FIFO, not a regular file"):
        names.open_private(str(tmp_path / "bell"), os.O_RDWR | os.O_NONBLOCK, stat.S_IFREG)
    mine = tmp_path / "mine"
    mine.write_bytes(b"")
    os.chmod(mine, 0o600)
    monkeypatch.setattr(os, "getuid", lambda: os.stat(mine).st_uid + 1)
    with pytest.raises(PipelineError, match="it belongs to uid .*, not to this process's"):
        names.open_private(str(mine), os.O_RDWR, stat.S_IFREG)


# ---- the first line names the rank at fault (issue 32) ---------------------------------------------------------
class _Board:
    failure: str | None = None

    def poll(self, finish: bool = False) -> None:
        pass

    def check(self) -> None:
        raise AssertionError("a wait's look at the board blocked on the store (board.check): it must poll")

    def fail(self, message: str) -> str:
        self.failure = self.failure or message
        return self.failure


def _guard(timeout: float) -> Guard:
    guard = Guard.__new__(Guard)  # no store, no process group: the deadline logic alone
    guard.board, guard.timeout, guard.me = _Board(), timeout, "rank 3"  # type: ignore[assignment]
    guard.scope, guard._next_look = "pipe", 0.0
    return guard


def test_a_wait_of_a_few_seconds_names_a_peer_in_another_call_before_the_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    read: list[tuple[str, str]] = []

    def diverged(me: str, scope: str) -> str:
        read.append((me, scope))
        return "global rank 0 is in sw.checkpoint.save while rank 3 waits in train_step" if len(read) > 1 else ""

    monkeypatch.setattr(divergence, "diverged", diverged)
    guard = _guard(300.0)
    guard.check_deadline(time.perf_counter() - 1.0, "x")  # under LOOK_AFTER_S: no read
    assert read == []
    guard.check_deadline(time.perf_counter() - 3.0, "x")  # read once: nothing diverges
    guard.check_deadline(time.perf_counter() - 3.1, "x")  # within a stamp of the last read: not read again
    assert read == [("rank 3", "pipe")]
    guard._next_look = 0.0
    with pytest.raises(PipelineError, match=r"^global rank 0 is in sw\.checkpoint\.save while rank 3 waits"):
        guard.check_deadline(time.perf_counter() - 3.2, "x")
    assert guard.board.failure.startswith("global rank 0 is in")  # type: ignore[union-attr]


def test_a_deadline_names_the_silent_rank_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(heartbeat, "silent_ranks", lambda threshold: [(3, 0.5), (2, 4.0), (1, 9.5)])
    monkeypatch.setattr(heartbeat.dist, "get_rank", lambda: 3)
    assert heartbeat.blame_silent(10.0) == "global ranks 1, 2 stopped or died (no sign of life for 9.5 s)"
    with pytest.raises(PipelineError) as err:
        _guard(1.0).check_deadline(time.perf_counter() - 2.0, "stage 2's output for micro-batch 1 from rank 2")
    first = str(err.value).splitlines()[0]
    assert first.startswith("global ranks 1, 2 stopped or died (no sign of life for 9.5 s); rank 3 waited 2.0 s"), first


def test_past_the_timeout_a_patient_wait_goes_on_while_every_rank_stamps(monkeypatch: pytest.MonkeyPatch) -> None:
    silent: list[tuple[int, float | None]] = []
    monkeypatch.setattr(heartbeat, "silent_ranks", lambda threshold: silent)
    monkeypatch.setattr(heartbeat.dist, "get_rank", lambda: 3)
    guard = _guard(1.0)
    guard.check_deadline(time.perf_counter() - 2.0, "the others' writing", patience=30.0)  # all alive: goes on
    with pytest.raises(PipelineError, match=r"rank 3 waited 31\.\d s .*; is another rank stuck or dead\? \(timeout=30"):
        guard.check_deadline(time.perf_counter() - 31.0, "the others' writing", patience=30.0)
    silent.append((0, 6.0))
    with pytest.raises(PipelineError, match=r"^global rank 0 stopped or died"):
        _guard(1.0).check_deadline(time.perf_counter() - 2.0, "the others' writing", patience=30.0)


def test_a_bounded_call_stops_at_a_failure_posted_for_the_job(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(coordinator, "_watch", None)
    coordinator.watch_calls(lambda: "rank 2: ValueError: boom", lambda timeout: "")
    finished, done = threading.Event(), threading.Event()

    def slow() -> None:
        done.wait(30)  # (the test lets it go at its end: a call left inside torch holds this process's exit)
        finished.set()

    try:
        with pytest.raises(PipelineError, match="^rank 2: ValueError: boom$"):
            coordinator.call_with_deadline(slow, 60.0, "the link probe")
        assert not finished.is_set()  # it stopped at the posted failure, not at the end of the call
        watched = "global rank 1 stopped or died (no sign of life for 3.0 s)"
        coordinator.watch_calls(lambda: None, lambda timeout: watched)
        with pytest.raises(
            PipelineError, match=r"^global rank 1 stopped or died .*: rank 0 waited 0.3 s for the probe"
        ):
            coordinator.call_with_deadline(lambda: done.wait(30), 0.3, "the probe", me="rank 0")
    finally:
        done.set()


# ---- a reused run id on a store that outlived its job (issue 32) -----------------------------------------------
def test_the_nonce_is_rank_0s_fresh_one_whatever_an_earlier_job_left(tmp_path: Path) -> None:
    store = dist.HashStore()
    store.set("hello/1", "stale")  # an earlier job's keys, as a long-lived store keeps them
    store.set("ack/1/stale", "old-nonce")
    store.set("got/stale/old-nonce", "1")
    got: dict[int, str] = {}

    def rank(r: int) -> None:
        got[r] = elect(store, r, 4, 30.0)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (1, 2, 3, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(got) == [0, 1, 2, 3] and len(set(got.values())) == 1 and got[0] != "old-nonce", got


# ---- nothing a peer sends is unpickled (issue 32) --------------------------------------------------------------
_PEER_PICKLES = {"all_gather_object", "broadcast_object_list", "scatter_object_list", "gather_object"}
_PEER_PICKLES |= {"send_object_list", "recv_object_list"}


def _calls(tree: ast.AST) -> list[tuple[int, str]]:
    """Every call of the tree as ``(line, dotted name)`` (``dist.all_gather_object``, ``pickle.loads``)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            parts, f = [], node.func
            while isinstance(f, ast.Attribute):
                parts.append(f.attr)
                f = f.value
            if isinstance(f, ast.Name):
                parts.append(f.id)
            out.append((node.lineno, ".".join(reversed(parts))))
    return out


def test_the_library_pickles_nothing_a_peer_sends() -> None:
    """No object collective (they pickle what a peer sends), no pickle.load(s), no torch.load in the library: the
    one unpickler is the checkpoint's, for DCP's own metadata files, with a fixed list of classes."""
    src = Path(stagewise.__file__).parent
    found = []
    for path in src.rglob("*.py"):
        for line, name in _calls(ast.parse(path.read_text())):
            last = name.rsplit(".", 1)[-1]
            if last in _PEER_PICKLES or name in ("pickle.load", "pickle.loads", "torch.load"):
                found.append(f"{path.relative_to(src)}:{line}: {name}")
    assert not found, found
