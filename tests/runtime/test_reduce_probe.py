"""The replicas' all-reduce probe times the reduce, not the world's barrier (issue 49, 2026-12-05).

Before each timed round every rank passes a barrier over the whole world; ranks leave it one by one, a link's
delay apart when the world spans machines, so a replica group inside one machine read the delay between its
ranks' exits as its own latency (10.4 ms a ring step at 10 ms between machines). One process, a fake
``torch.distributed`` on a fake clock: this rank's group peer leaves the world's barrier 10 ms after it.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from stagewise.runtime.comm import collectives, groups
from stagewise.runtime.measure import links

SKEW = 0.010  # the peer's exit from the world's barrier after this rank's
ALPHA, BETA = 1e-4, 1e-9  # the group's true all-reduce: ALPHA + bytes x BETA seconds


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.peer_ready = 0.0
        self.calls: list[str] = []
        self.made: list[tuple[int, ...]] = []
        self.destroyed: list[tuple[int, ...]] = []

    def new_group(self, ranks: list[int]) -> tuple[int, ...]:
        self.made.append(tuple(ranks))
        return tuple(ranks)

    def barrier(self, group: Any = None) -> None:
        self.calls.append("world" if group is None else "group")
        if group is None:  # the world's: this rank goes first, its peer SKEW later
            self.peer_ready = self.now + SKEW
        else:  # the group's: both leave once both are in
            self.now = max(self.now, self.peer_ready)

    def all_reduce(self, t: Any, op: Any = None, group: Any = None, async_op: bool = False) -> Any:
        self.calls.append("reduce")
        self.now = max(self.now, self.peer_ready) + ALPHA + t.numel() * t.element_size() * BETA
        return SimpleNamespace(wait=lambda: None) if async_op else None


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    c = _Clock()
    fake = SimpleNamespace(
        get_world_size=lambda: 4, get_rank=lambda: 0, new_group=c.new_group, destroy_process_group=c.destroyed.append,
        barrier=c.barrier, all_reduce=c.all_reduce, ReduceOp=SimpleNamespace(MAX="max"),
    )  # fmt: skip
    monkeypatch.setattr(links, "dist", fake)
    # the runtime's SYNC (GradAverager) reduces through the collectives module and sizes its group through groups
    monkeypatch.setattr(collectives, "dist", SimpleNamespace(all_reduce=c.all_reduce))
    monkeypatch.setattr(groups, "dist", SimpleNamespace(get_world_size=lambda group=None: 2 if group else 4))
    monkeypatch.setattr(links.time, "perf_counter", lambda: c.now)
    monkeypatch.setattr(links, "_bounded", lambda fn, deadline, what: fn())
    monkeypatch.setattr(links, "slowest", lambda seconds, deadline: seconds)
    return c


def test_the_probe_reads_the_group_s_reduce_not_the_world_s_barrier_exits(clock: _Clock) -> None:
    link = links.all_reduce_link(2)
    assert link is not None
    share, steps = 1.0, 2  # dp 2: half the bytes each way, two ring steps
    assert link.bandwidth == pytest.approx(1 / (BETA / share))
    assert link.latency == pytest.approx(ALPHA / steps)  # the skew read as latency: (ALPHA + SKEW) / 2


def test_alone_each_replica_group_reduces_in_a_turn_of_its_own(clock: _Clock) -> None:
    """World 4, dp 2: groups (0, 1) and (2, 3). Together, every round is one world barrier then this group's
    reduce; alone (``alone=True``, the replicas' SYNC timed as their node's CPU work), each round passes a world
    barrier for each group's turn and this rank reduces only in its own, so the other group's reduce never runs
    beside it. Either way the link read is the group's own."""
    together = links.all_reduce_link(2, rounds=3)
    rounds = clock.calls[clock.calls.index("reduce") + 1 :]  # after the first size's untimed reduce
    assert rounds[:9] == ["world", "group", "reduce"] * 3
    clock.calls.clear()
    alone = links.all_reduce_link(2, rounds=3, alone=True)
    rounds = clock.calls[clock.calls.index("reduce") + 1 :]
    assert rounds[:12] == ["world", "group", "reduce", "world"] * 3  # this group's turn, then the other's
    assert together is not None and alone is not None
    assert alone.bandwidth == pytest.approx(together.bandwidth) and alone.latency == pytest.approx(together.latency)


def test_the_cpu_share_is_read_from_the_sync_alone_and_with_every_group_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``all_reduce_cpu`` times the larger size alone and at once: 20 ms alone, 30 ms with 2 processes a core is
    a CPU part of 10 ms (it ran twice as slow) beside a 10 ms wait: half."""
    asked: list[tuple[tuple[int, ...], bool]] = []

    def medians(dp: int, sizes: tuple[int, ...], rounds: int, timeout: float, alone: bool) -> list[float]:
        asked.append((sizes, alone))
        return [0.020 if alone else 0.030]

    monkeypatch.setattr(links, "_synced_medians", medians)
    assert links.all_reduce_cpu(2, sharing=2.0) == pytest.approx(0.5)
    assert asked == [(links.REDUCE_SIZES[-1:], True), (links.REDUCE_SIZES[-1:], False)]


def test_the_probe_lets_its_groups_go(clock: _Clock) -> None:
    """Each call makes a group per replica set and destroys them after: called again and again in one process it
    read 0.0-1.0 for a share of about 0.5, its groups' threads and sockets piling up (2026-12-06)."""
    for _ in range(3):
        links.all_reduce_link(2, alone=True)
    assert clock.made == clock.destroyed and len(clock.made) == 3 * 2  # 3 calls x 2 replica groups (4 ranks, dp 2)
