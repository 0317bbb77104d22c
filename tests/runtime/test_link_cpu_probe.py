"""The probe of a message's CPU on the link (``links.link_cpu``, issue 49, 2026-12-06).

One process, a fake ``torch.distributed`` on a fake clock: the compute loop takes 1 ms a round alone and
``1 + SHARE`` ms a round while messages are posted and not yet all waited for; each message waited for takes
``MESSAGE`` s. The peer (the fake's other end) proposes a longer stream than this rank would: both ends must
post the same count, or the longer one waits for messages that never come (it hung so, live, before the count
was agreed).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from stagewise.runtime.measure import links

SHARE = 0.3  # the slowdown of the compute beside the stream
MESSAGE = 0.01  # seconds a message takes on the link
PEER_COUNT = 500  # the peer's proposal for the stream's length (this rank would ask for fewer)


class _Fake:
    def __init__(self) -> None:
        self.now = 0.0
        self.open = 0  # messages posted and not yet waited for
        self.posted: list[int] = []  # each stream's length, as posted
        self.ops: list[str] = []

    def compute(self, n: int) -> None:
        self.now += n * 1e-3 * (1 + SHARE if self.open else 1.0)

    def post(self, kind: str) -> Any:
        self.open += 1
        self.ops.append(kind)

        def wait() -> None:
            self.open -= 1
            self.now += MESSAGE

        return SimpleNamespace(wait=wait)

    def all_reduce(self, t: Any, op: Any = None, group: Any = None) -> None:
        if op == "max":  # the count: the peer's proposal is the larger
            t.fill_(max(int(t), PEER_COUNT))


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> _Fake:
    f = _Fake()
    dist = SimpleNamespace(
        get_rank=lambda: 0, get_world_size=lambda: 2, new_group=lambda ranks: tuple(ranks),
        destroy_process_group=lambda g: None,
        barrier=lambda group=None: None, all_reduce=f.all_reduce, ReduceOp=SimpleNamespace(MAX="max", MIN="min"),
        isend=lambda buf, peer: f.post("send"), irecv=lambda buf, peer: f.post("recv"),
    )  # fmt: skip
    monkeypatch.setattr(links, "dist", dist)
    monkeypatch.setattr(links.time, "perf_counter", lambda: f.now)
    monkeypatch.setattr(links, "_compute", f.compute)
    monkeypatch.setattr(links, "_bounded", lambda fn, deadline, what: fn())
    monkeypatch.setattr(links, "summed", lambda values, deadline: [2 * values[0]])  # the peer read the same
    return f


def test_the_share_is_the_compute_s_slowdown_beside_the_stream(fake: _Fake) -> None:
    assert links.link_cpu(0, 1, rounds=3) == pytest.approx(SHARE)
    assert set(fake.ops) == {"send"}  # rank 0 streams to rank 1


def test_both_ends_post_the_count_they_agreed(fake: _Fake) -> None:
    links.link_cpu(0, 1, rounds=2)
    streams = len(fake.ops) - 8  # after the 8 messages that time the link
    assert streams == 2 * PEER_COUNT


def test_the_share_is_clipped_to_a_core(fake: _Fake, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(links, "summed", lambda values, deadline: [2 * 1.7])
    assert links.link_cpu(0, 1) == 1.0


def test_a_pair_that_is_not_two_ranks_is_refused(fake: _Fake) -> None:
    with pytest.raises(ValueError, match="two ranks of the 2 processes, got 1 and 1"):
        links.link_cpu(1, 1)
    with pytest.raises(ValueError, match="got 0 and 2"):
        links.link_cpu(0, 2)
    assert fake.ops == []  # refused before anything was posted
