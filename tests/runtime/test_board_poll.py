"""A wait's look at the error board never blocks on the store host (issue 49, 2026-12-05).

A far machine's ranks read the board through a store on another machine; read in the waiting thread, every
poll of a long wait held the step two round trips (40 ms at 10 ms of link delay) after its works had completed.
The reads now go to the store's helper thread; what one found stands at the next poll. One process, no store
host: a fake store that answers only when the test lets it.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from stagewise.runtime.comm.coordinator import DeadlineStore
from stagewise.runtime.comm.faults import board as board_module
from stagewise.runtime.comm.faults.board import ErrorBoard
from stagewise.runtime.comm.faults.keys import JOB_KEY, SEEN_KEY
from stagewise.runtime.errors import PipelineError


class _FarStore:
    """Each ``check`` waits until the test releases it (a store host a long round trip away)."""

    def __init__(self, posted: dict[str, str] | None = None) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.keys = dict(posted or {})
        self.answered = 0

    def check(self, keys: list[str]) -> bool:
        self.entered.set()
        assert self.release.wait(30), "the test never let the store answer"
        self.answered += 1
        return all(k in self.keys for k in keys)

    def get(self, key: str) -> bytes:
        return self.keys[key].encode()

    def set(self, key: str, value: str) -> None:
        self.keys[key] = value


@pytest.fixture
def stood(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The failures that stood (instead of telling this test process's exit hook), the rank the board names."""
    seen: list[str] = []
    monkeypatch.setattr(board_module, "note_failure", seen.append)
    monkeypatch.setattr(board_module.dist, "get_rank", lambda: 1)
    return seen


def _board(store: Any, timeout: float = 30.0) -> ErrorBoard:
    board = ErrorBoard.__new__(ErrorBoard)  # no process group: the board over a store of the test's
    board.me, board.store, board.name, board.key = "rank 1", DeadlineStore(store, timeout), "b", "b/error"
    board.failure, board._on_failure, board._look = None, [], None
    board._polling = threading.RLock()
    return board


def test_a_poll_returns_while_the_store_has_not_answered(stood: list[str]) -> None:
    far = _FarStore()
    board = _board(far)
    board.poll()  # posts the read and returns: the store is still in the read (entered, not released)
    assert far.entered.wait(30) and not far.release.is_set()
    board.poll()  # the read in flight: no second one, no wait
    assert far.answered == 0 and board.failure is None
    far.release.set()
    assert board._look is not None and board._look.done.wait(30)
    first = board._look
    assert far.answered == 2  # one read: both keys (the job's, the board's)
    board.poll()  # nothing found: a new read goes out
    assert board.failure is None and stood == [] and board._look is not None and board._look is not first


def test_a_failure_the_read_found_stands_at_the_next_poll(stood: list[str]) -> None:
    far = _FarStore({JOB_KEY: "rank 2: ValueError: boom"})
    far.release.set()
    board = _board(far)
    board.poll()
    assert board._look is not None and board._look.done.wait(30)
    with pytest.raises(PipelineError, match="rank 2: ValueError: boom"):
        board.poll()
    assert stood == ["rank 2: ValueError: boom"] and f"{SEEN_KEY}/1" in far.keys  # the origin waits for readers


def test_a_read_that_never_returns_is_the_coordinator_unreachable(stood: list[str]) -> None:
    far = _FarStore()
    board = _board(far, timeout=0.0)  # any read in flight is past the deadline at the next poll
    board.poll()
    assert far.entered.wait(30)
    with pytest.raises(PipelineError, match="did not answer within"):
        board.poll()
    with pytest.raises(TimeoutError, match="an earlier store call has not returned"):
        board.store.get("k")  # the helper is stuck in the read: the client is refused, as after a sync call
    far.release.set()


def test_past_its_deadline_a_wait_waits_for_the_read_as_a_blocking_check_did(stood: list[str]) -> None:
    """A wait past its deadline names the cause: the store's answer when it comes (the read is waited for), the
    coordinator unreachable when it does not come within the store's timeout."""
    answering = _FarStore({JOB_KEY: "rank 2: ValueError: boom"})
    answering.release.set()
    with pytest.raises(PipelineError, match="rank 2: ValueError: boom"):
        _board(answering).poll(finish=True)  # no read before: one is posted and its answer read at once
    silent = _FarStore()
    board = _board(silent, timeout=0.3)
    board.poll()
    with pytest.raises(PipelineError, match="unreachable.*did not answer within 0.3 s"):
        board.poll(finish=True)
    silent.release.set()


def test_two_threads_polling_one_board_post_one_read(stood: list[str]) -> None:
    """The board's poll is one step at a time: a second thread that polls while the first is posting its read
    finds that read in flight and posts none (the two would otherwise both post, and both report a failure)."""
    far = _FarStore()  # (answers once the threads are done: the first read stays in flight)
    board = _board(far)
    posted, first_in, second_in = [], threading.Event(), threading.Event()
    post = board.store.post

    def slow_post(fn: Any) -> Any:
        posted.append(threading.current_thread().name)
        if not first_in.is_set():
            first_in.set()
            second_in.wait(0.5)  # the second poller, unless it is held at the lock, posts meanwhile
        else:
            second_in.set()
        return post(fn)

    board.store.post = slow_post  # type: ignore[method-assign]
    first = threading.Thread(target=board.poll, name="first")
    first.start()
    assert first_in.wait(30)
    second = threading.Thread(target=board.poll, name="second")
    second.start()
    first.join(30)
    second.join(30)
    far.release.set()
    assert posted == ["first"] and board.failure is None
