"""The collective calls each process counts, and the divergences a waiting rank reads from a peer's count.

The n-th call must be the same call on every rank; a peer merely behind (writing the checkpoint this rank has
left) or ahead is not a divergence, and must never be named one (a false one would stop a correct job).
"""

from __future__ import annotations

import pytest

from stagewise.runtime.comm.faults import calls
from stagewise.runtime.comm.faults.calls import Divergence, History, judge

pytestmark = pytest.mark.runtime


def _made(*kinds: str, inside: bool = True) -> History:
    h = History()
    for k in kinds:
        h.enter(k)
    h.depth = 1 if inside else 0
    return h


def test_kinds_are_counted_in_runs_and_read_back_by_number() -> None:
    h = _made("train_step", "train_step", "save", "train_step", "eval_loss", "eval_loss")
    assert h.runs == [["train_step", 2], ["save", 1], ["train_step", 1], ["eval_loss", 2]]
    got = [h.kind_at(n) for n in range(0, 8)]
    assert got == [None, "train_step", "train_step", "save", "train_step", "eval_loss", "eval_loss", None]
    assert h.published() == "6 eval_loss in"
    h.depth = 0
    assert h.published() == "6 eval_loss after"
    h.ended = True
    assert h.published() == "6 eval_loss ended"


def test_a_call_inside_a_call_counts_once_and_a_reset_starts_from_zero() -> None:
    calls.reset()
    try:
        with calls.call("eval_loss", "p0"):
            with calls.call("eval_step", "p0"):  # eval_loss runs an eval_step: one collective call
                assert calls.published() == {"p0": "1 eval_loss in"}
        assert calls.published() == {"p0": "1 eval_loss after"}
        with calls.call("train_step", "p0"), calls.call("train_step", "p1"):  # another pipeline counts its own
            pass
        assert calls.published() == {"p0": "2 train_step after", "p1": "1 train_step after"}
        calls.ended()
        assert calls.published() == {"p0": "2 train_step ended", "p1": "1 train_step ended"}
        assert calls.current("p1").count == 1 and calls.current("p2").count == 0
    finally:
        calls.reset()
    assert calls.published() == {}


def test_another_call_at_the_same_count_is_named() -> None:
    mine = _made("train_step", "train_step", "train_step")
    said = _words(judge(mine, "global rank 0", "3 save in", "rank 1"))
    assert said.startswith(
        "global rank 0 is in sw.checkpoint.save while rank 1 waits in train_step (the 3rd collective call of each): "
    )
    assert "make each call on every rank" in said
    after = _words(judge(mine, "global rank 0", "3 save after", "rank 1"))
    assert after.startswith("global rank 0 has made sw.checkpoint.save")


def test_a_peer_behind_in_the_same_calls_is_no_divergence_but_one_in_another_call_is() -> None:
    mine = _made("train_step", "train_step", "save", "train_step")  # left the save; the peer still writes it
    assert judge(mine, "global rank 1", "3 save in", "rank 0") is None
    assert judge(mine, "global rank 1", "2 train_step in", "rank 0") is None
    assert judge(mine, "global rank 1", "4 train_step in", "rank 0") is None
    said = _words(judge(mine, "global rank 1", "3 eval_loss in", "rank 0"))
    assert said.startswith(
        "global rank 1 is in eval_loss as its 3rd collective call, where rank 0 made a sw.checkpoint.save; rank 0 "
        "waits in its 4th collective call, a train_step"
    )


def test_a_peer_ahead_or_not_started_or_unreadable_is_left_to_itself() -> None:
    mine = _made("train_step", "train_step")
    assert judge(mine, "global rank 1", "5 save in", "rank 0") is None  # it waits on us, and says so
    assert judge(mine, "global rank 1", "0 - after", "rank 0") is None
    assert judge(mine, "global rank 1", "garbled", "rank 0") is None
    outside = _made("train_step", "train_step", inside=False)  # this rank waits outside any counted call
    assert judge(outside, "global rank 1", "2 save in", "rank 0") is None


def test_a_script_that_ended_before_this_call_is_named_and_one_that_ended_after_it_is_not() -> None:
    mine = _made("train_step", "train_step", "train_step")
    said = _words(judge(mine, "global rank 1", "2 train_step ended", "rank 0"), ended=True)
    assert said.startswith(
        "global rank 1's script ended after 2 collective calls, the last a train_step, while rank 0 waits in its 3rd "
        "collective call, a train_step"
    )
    assert _words(judge(mine, "global rank 1", "0 - ended", "rank 0"), ended=True).startswith(
        "global rank 1's script ended after 0 collective calls, while"
    )
    assert judge(mine, "global rank 1", "3 train_step ended", "rank 0") is None


def _words(found: Divergence | None, ended: bool = False) -> str:
    assert found is not None and found.ended == ended
    return found.words


@pytest.mark.parametrize(
    "n,words",
    [
        (1, "1st"),
        (2, "2nd"),
        (3, "3rd"),
        (4, "4th"),
        (11, "11th"),
        (12, "12th"),
        (13, "13th"),
        (21, "21st"),
        (112, "112th"),
        (101, "101st"),
    ],
)
def test_ordinals(n: int, words: str) -> None:
    assert calls._nth(n) == f"{words} collective call"


class _Store:
    """The heartbeat's store, holding what each peer published."""

    def __init__(self, values: dict[str, str]) -> None:
        self.values = values

    def check(self, keys: list[str]) -> bool:
        return all(k in self.values for k in keys)

    def get(self, key: str) -> bytes:
        return self.values[key].encode()


def test_peers_are_read_in_order_and_only_an_ended_script_is_blamed_for_a_closed_connection(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """diverged names the first peer that diverges; blame_ended and ended_words only a peer whose script ended
    (a closed connection from a peer merely in another call is a death, told as one)."""
    from types import SimpleNamespace

    from stagewise.runtime.comm.faults import divergence, heartbeat

    store = _Store({"at/1/p": "2 save in", "at/3/p": "1 train_step ended"})
    monkeypatch.setattr(heartbeat, "store", lambda: store)
    monkeypatch.setattr(divergence, "dist", SimpleNamespace(get_rank=lambda: 0, get_world_size=lambda: 4))
    calls.reset()
    try:
        for _ in range(2):
            with calls.call("train_step", "p"):
                pass
        with calls.call("train_step", "p"):  # this rank waits in its 3rd call
            said = divergence.diverged("rank 0", "p")  # (this rank is global rank 0: named as its peers are)
            assert said.startswith("global rank 1 is in sw.checkpoint.save as its 2nd collective call, where global "
                                   "rank 0 made a train_step; global rank 0 waits in its 3rd")  # fmt: skip
            assert "pipeline rank 2 (global rank 0) waits" in divergence.diverged(
                "pipeline rank 2 (global rank 0)", "p"
            )
            ended = "global rank 3's script ended after 1 collective call, the last a train_step, while global rank 0"
            assert divergence.blame_ended("p").startswith(ended)
            assert divergence.ended_words(3, "p").startswith(ended)
            assert divergence.ended_words(1, "p") == ""  # in another call, not ended
            assert divergence.ended_words(2, "p") == ""  # published nothing
            assert divergence.diverged("rank 0", "other") == ""  # another pipeline's calls
            monkeypatch.setattr(heartbeat, "store", lambda: None)
            assert divergence.diverged("rank 0", "p") == "" and divergence.blame_ended("p") == ""  # no evidence
    finally:
        calls.reset()
