"""Membership of an in-place elastic job on a store (runtime/elastic/membership.py): one process, a TCPStore,
members as threads. Who is agreed on, in what order things happen, and who is fenced - never how long."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from stagewise.runtime.elastic import membership as ms


@pytest.fixture
def host() -> Any:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def _member(host: Any, me: int, members: list[int]) -> ms.Membership:
    client = dist.TCPStore("127.0.0.1", host.port, is_master=False, timeout=timedelta(seconds=20))
    return ms.Membership(dist.PrefixStore("job/", client), me, members, silent_s=2.0).start()  # (4 stamps)


def _all_next(people: list[ms.Membership], deadline: float = 20.0) -> dict[int, Any]:
    got: dict[int, Any] = {}

    def one(m: ms.Membership) -> None:
        try:
            got[m.me] = m.next(deadline)
        except ms.Fenced as err:
            got[m.me] = err

    threads = [threading.Thread(target=one, args=(m,)) for m in people]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return got


def test_the_survivors_agree_on_the_next_generation_without_the_silent_member(host: Any) -> None:
    people = [_member(host, i, [0, 1, 2]) for i in range(3)]
    people[2].stop()  # machine 2 lost: its stamp stops moving, it never asks for generation 1
    got = _all_next(people[:2])
    assert got == {0: [0, 1], 1: [0, 1]}
    assert [m.generation for m in people] == [1, 1, 0] and people[1].rank == 1
    with pytest.raises(ms.Fenced, match="generation 0 .* generation 1"):
        people[2].fenced("a snapshot")  # woken behind the job: it writes nothing
    people[0].fenced("a snapshot")  # the members are not fenced
    for m in people[:2]:
        m.stop()


def test_a_member_that_arrives_after_the_decision_is_fenced(host: Any) -> None:
    people = [_member(host, i, [0, 1, 2]) for i in range(3)]
    people[2].stop()
    assert _all_next(people[:2]) == {0: [0, 1], 1: [0, 1]}
    late = ms.Membership(people[2].store, 2, [0, 1, 2], silent_s=0.3)  # its own view: still generation 0
    with pytest.raises(ms.Fenced):
        late.next(5.0)
    for m in people[:2]:
        m.stop()


def test_a_member_missing_at_the_barrier_starts_one_more_generation_without_it(host: Any) -> None:
    people = [_member(host, i, [0, 1, 2]) for i in range(3)]
    people[2].store.set("gen1/arrived/2", "1")  # it asked for generation 1, then died before the barrier
    people[2].stop()
    got = _all_next(people[:2], deadline=5.0)
    assert got == {0: [0, 1], 1: [0, 1]}
    assert [m.generation for m in people[:2]] == [2, 2] and people[0].current() == 2
    for m in people[:2]:
        m.stop()


def test_the_fence_is_asked_before_a_write_only_in_an_in_place_job() -> None:
    ms.set_fence(None)
    ms.check_fence("a checkpoint")  # outside an in-place job: nothing to ask

    def behind(what: str) -> None:
        raise ms.Fenced(f"behind: no {what}")

    ms.set_fence(behind)
    try:
        with pytest.raises(ms.Fenced, match="no a checkpoint"):
            ms.check_fence("a checkpoint")
        assert ms.last_fence() == "behind: no a checkpoint"
    finally:
        ms.set_fence(None)


def test_a_member_lost_while_the_generation_is_made_costs_one_more_generation(monkeypatch: pytest.MonkeyPatch) -> None:
    """sw.runtime.InPlace's recovery: the group's handshake (or the resume) of generation 1 fails - a member died after
    the agreement - so the survivors agree on generation 2 and enter it; a fenced worker leaves (exit 3)."""
    from stagewise.runtime.relayout import generation

    class Members:
        generation, agreed = 0, [[0, 1, 2], [0, 1]]

        def next(self, deadline_s: float, gone: object = (), still_gone: object = None) -> list[int]:
            self.generation += 1
            return self.agreed.pop(0)

        def stop(self) -> None:
            events.append(("stopped", 0))

    events: list[tuple[str, int]] = []

    def enter(self: generation.InPlace, g: int) -> None:
        events.append(("enter", g))
        if g == 1:
            raise RuntimeError("connectFullMesh: a member of generation 1 is gone")

    monkeypatch.setattr(generation.InPlace, "_enter", enter)
    job = generation.InPlace(sw_layout(), lambda fit: None, checkpoints="unused")
    job._members = Members()  # type: ignore[assignment]
    assert job._next_generation([]) == [0, 1]
    assert events == [("enter", 1), ("enter", 2)]

    class Behind(Members):
        def next(self, deadline_s: float, gone: object = (), still_gone: object = None) -> list[int]:
            raise ms.Fenced("worker 2 is fenced")

    job._members = Behind()  # type: ignore[assignment]
    monkeypatch.setattr(generation, "leave_generation", lambda: events.append(("left", 0)))
    with pytest.raises(SystemExit) as left:
        job._next_generation([])
    assert left.value.code == generation.FENCED_EXIT and events[-2:] == [("stopped", 0), ("left", 0)]


def sw_layout() -> Any:
    from stagewise import ElasticLayout

    return ElasticLayout(pp=1, batch=24, microbatch_size=2)


def test_the_members_a_failure_names_dead_are_not_waited_for(host: Any) -> None:
    assert ms.named_dead("x: global rank 2 stopped or died (no sign of life for 2.5 s): y", [0, 1, 5]) == [5]
    assert ms.named_dead("global ranks 0, 2 stopped or died (...)", [4, 6, 7]) == [4, 7]
    assert ms.named_dead("Connection reset by peer", [0, 1]) == []
    people = [_member(host, i, [0, 1, 2]) for i in range(3)]
    for m in people:
        m.silent_s = 60.0  # only the name spares the wait (a deadline of 60 s would fail the join below)
    people[2].stop()
    got: dict[int, Any] = {}
    threads = [threading.Thread(target=lambda m=m: got.update({m.me: m.next(60.0, gone=[2])})) for m in people[:2]]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert got == {0: [0, 1], 1: [0, 1]}, got
    # whichever of the two proposed first counted worker 2 out by the name; the other took that decision (which one
    # it is depends on the threads' order, not on the rule)
    reasons = sorted(m.decided[2] for m in people[:2])
    assert "named dead" in reasons and set(reasons) <= {"named dead", "another decided"}, reasons
    for m in people[:2]:
        m.stop()


def test_a_member_silent_since_before_the_agreement_is_counted_by_its_stamps_age(host: Any) -> None:
    """A stopped machine's second worker: the failure named only the first, and the second's stamp stopped with
    it, a threshold before the agreement began. Its stamp's own time counts it gone at once, not a threshold
    after the agreement first saw it (the stop's and partition's second threshold)."""
    people = [_member(host, i, [0, 1, 2]) for i in range(3)]
    for m in people:
        m.silent_s = 600.0  # the threshold: waiting it out from the agreement's start would fail the join below
    people[2].stop()
    people[0].store.set("alive/2", repr(time.time() - 700.0))  # its last stamp, before the threshold
    got: dict[int, Any] = {}
    threads = [threading.Thread(target=lambda m=m: got.update({m.me: m.next(600.0)})) for m in people[:2]]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert got == {0: [0, 1], 1: [0, 1]}
    counted = [p.decided[2] for p in people[:2]]
    assert any(c.startswith("silent 7") for c in counted), counted  # (its age: 700 s and a little)
    for m in people[:2]:
        m.stop()


def test_a_member_slow_for_less_than_the_threshold_is_kept(host: Any) -> None:
    people = [_member(host, i, [0, 1, 2]) for i in range(3)]
    for m in people:
        m.silent_s = 30.0  # the hang threshold (an in-place job's timeout)
    people[2].stop()  # stopped (SIGSTOP): no stamp, no request, until it is woken
    got: dict[int, Any] = {}
    threads = [threading.Thread(target=lambda m=m: got.update({m.me: m.next(60.0)})) for m in people[:2]]
    for t in threads:
        t.start()
    while not all(people[0].store.check([f"gen1/arrived/{i}"]) for i in (0, 1)):
        time.sleep(0.01)
    time.sleep(3 * ms.STAMP_S)  # the others watch its stamp stand still
    late = threading.Thread(target=lambda: got.update({2: people[2].next(60.0)}))
    late.start()  # woken before the threshold: it asks after the others did
    for t in [*threads, late]:
        t.join(30)
    assert got == {0: [0, 1, 2], 1: [0, 1, 2], 2: [0, 1, 2]}
    assert people[0].decided[2].startswith("asked at")  # never counted gone, by silence or otherwise
    for m in people:
        m.stop()


def test_a_member_gone_by_evidence_found_while_waiting_is_not_waited_for(host: Any) -> None:
    people = [_member(host, i, [0, 1, 2]) for i in range(3)]
    for m in people:
        m.silent_s = 60.0  # only the evidence spares the wait (its absence would fail the join below)
    people[2].stop()
    seen = threading.Event()  # the evidence comes only once the others wait (a process that died after them)

    def evidence() -> list[int]:
        return [2] if seen.is_set() else []

    got: dict[int, Any] = {}
    threads = [threading.Thread(target=lambda m=m: got.update({m.me: m.next(60.0, (), evidence)})) for m in people[:2]]
    for t in threads:
        t.start()
    while not all(people[0].store.check([f"gen1/arrived/{i}"]) for i in (0, 1)):
        time.sleep(0.01)
    seen.set()
    for t in threads:
        t.join(30)
    assert got == {0: [0, 1], 1: [0, 1]}
    counted = [p.decided[2] for p in people[:2]]  # one decided by the port; the other may take its decision
    assert any(c.startswith("port refuses at") for c in counted), counted
    assert all(c.startswith("port refuses at") or c == "another decided" for c in counted), counted
    assert people[0].decided[0].startswith("asked at")
    for m in people[:2]:
        m.stop()


def test_a_survivor_without_evidence_takes_the_generation_another_decided_at_once(host: Any) -> None:
    """A partition seen first by a survivor whose failure names nobody (a snapshot copy that timed out) and then
    by one whose failure names the lost member: the first must not wait out its deadline while the second's
    barrier waits for it (seen in chaos: both sides fenced each other and the job ended)."""
    people = [_member(host, i, [0, 1, 2]) for i in range(3)]
    for m in people:
        m.silent_s = 60.0  # neither silence nor the deadline may decide within the join below
    people[2].stop()
    got: dict[int, Any] = {}
    first = threading.Thread(target=lambda: got.update({1: people[1].next(60.0)}))
    first.start()
    while not people[0].store.check(["gen1/arrived/1"]):
        time.sleep(0.01)
    second = threading.Thread(target=lambda: got.update({0: people[0].next(60.0, gone=[2])}))
    second.start()
    for t in (first, second):
        t.join(30)
    assert got == {0: [0, 1], 1: [0, 1]}
    for m in people[:2]:
        m.stop()


def test_a_proposal_takes_in_only_the_newcomers_that_leave_a_size_the_layout_can_use(host: Any) -> None:
    people = [_member(host, i, [0, 1]) for i in range(2)]
    for m in people:
        m.usable = lambda n: n % 2 == 0  # (pp 2: an even number of processes)
    people[0].store.set("gen1/joiners", "[3]")  # one newcomer of a machine of two asked: 3 processes cannot run
    assert _all_next(people) == {0: [0, 1], 1: [0, 1]}
    assert people[0].store.get("gen1/members") == b"[0, 1]"  # left out: it asks for the next generation
    people[0].store.set("gen2/joiners", "[3, 2]")
    got = _all_next(people, 2.0)  # (the newcomers are not here to pass the barrier: generation 3 follows)
    assert people[0].store.get("gen2/members") == b"[0, 1, 2, 3]" and got == {0: [0, 1], 1: [0, 1]}
    for m in people:
        m.stop()


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_a_member_whose_stamp_stands_still_past_the_threshold_is_silent_and_a_live_one_is_not(host: Any) -> None:
    store = dist.PrefixStore("job/", dist.TCPStore("127.0.0.1", host.port, is_master=False))
    clock = _Clock()
    m = ms.Membership(store, 0, [0, 1, 2], silent_s=3.0, clock=clock)  # (not started: the looks are this test's)
    for k in range(8):  # a look every half second; member 1 stamps every time, member 2 stopped before the first
        clock.t = 0.5 * k
        store.set("alive/1", repr(100.0 + k))
        store.set("alive/2", "50.0")
        m.look()
    assert clock.t == 3.5 and m.silent() == [(2, 3.5)]  # seen standing still since the first look, 3.5 s ago
    m.silent_s = 4.0
    assert m.silent() == []  # not yet at this threshold


def test_after_a_gap_in_its_own_looks_a_worker_names_nobody_silent(host: Any) -> None:
    store = dist.PrefixStore("job/", dist.TCPStore("127.0.0.1", host.port, is_master=False))
    clock = _Clock()
    m = ms.Membership(store, 0, [0, 1, 2], silent_s=3.0, clock=clock)
    store.set("alive/1", "1.0")
    store.set("alive/2", "1.0")
    m.look()
    clock.t = 5.0  # this worker was itself stopped (or its store client held) for 5 s: nobody's silence is its own
    assert m.silent() == []
    m.look()  # watched afresh from here
    assert m.silent() == []
    for k in range(1, 8):
        clock.t = 5.0 + 0.5 * k
        m.look()
    assert [who for who, _ in m.silent()] == [1, 2]  # (3.5 s of unbroken watching since)


def test_while_watching_a_stopped_member_is_reported_by_its_rank_and_only_then(host: Any) -> None:
    people = [_member(host, i, [0, 3, 7]) for i in (0, 3, 7)]
    for m in people:
        m.silent_s = 1.0
    reports: list[list[tuple[int, float]]] = []
    told = threading.Event()

    def report(silent: list[tuple[int, float]]) -> None:
        reports.append(silent)
        told.set()

    time.sleep(4 * ms.STAMP_S)  # every member stamped under its id, and was looked at moving
    with people[0].watching(report):
        time.sleep(4 * ms.STAMP_S)
        assert reports == []  # every member stamps: nobody silent
        people[2].stop()  # id 7, rank 2 in this generation
        assert told.wait(30)
    assert {rank for r in reports for rank, _ in r} == {2} and all(s >= 1.0 for r in reports for _, s in r)
    assert people[0].on_silent is None  # not watching once the step is over
    reports.clear()
    time.sleep(4 * ms.STAMP_S)
    assert reports == []
    for m in people[:2]:
        m.stop()


def test_the_silence_posted_is_in_the_words_the_recovery_reads_as_named_dead() -> None:
    from stagewise.runtime.comm.faults import heartbeat

    words = heartbeat.blame([(2, 3.1)])
    assert words.startswith("global rank 2 stopped or died") and ms.named_dead(words, [0, 3, 7]) == [7]
    assert ms.named_dead(heartbeat.blame([(1, 3.0), (2, 3.0)]), [0, 3, 7]) == [3, 7]


def test_survivors_the_layout_cannot_run_on_leave_the_broken_machines_members_first(host: Any) -> None:
    """Three machines of two (ids 0-5); worker 3 named silent while its machine's worker 2 lives: 5 survivors,
    and pp 2 cannot run on an odd number. The job goes on with 4 - machine 1's last worker, 2, leaves (fenced,
    saying why), not a worker of a whole machine - rather than fail every generation it tries (seen: 3 of 4
    left after a false silence under load, 4 generations refused, the job ended; faults 2026-12-04 02:06)."""
    people = [_member(host, i, list(range(6))) for i in range(6)]
    for m in people:
        m.usable, m.per_machine = (lambda n: n % 2 == 0), 2
    people[3].stop()
    alive = [m for m in people if m.me != 3]
    got = _all_next(alive, 2.0)
    assert people[0].store.get("gen1/members") == b"[0, 1, 4, 5]"
    assert {k: v for k, v in got.items() if k != 2} == {
        0: [0, 1, 4, 5],
        1: [0, 1, 4, 5],
        4: [0, 1, 4, 5],
        5: [0, 1, 4, 5],
    }
    assert isinstance(got[2], ms.Fenced)
    assert str(got[2]) == (
        "worker 2 is left out of generation 1: the layout cannot use its 5 survivors, only [0, 1, 4, 5]; it leaves "
        "(its machine may join again as a newcomer)"
    )
    for m in alive:
        m.stop()


def test_without_machines_known_the_newest_survivors_leave_and_a_usable_size_is_kept_whole() -> None:
    """The rule alone: no machine size known, the newest ids leave first; a size the layout runs at, or one
    made usable by the newcomers taken in, keeps every survivor; no size at all: unchanged (the build refuses)."""
    m = ms.Membership(store=None, me=0, members=[0, 1, 2, 3, 4], usable=lambda n: n % 3 == 0)
    assert m._runnable([0, 1, 2, 3, 4], 0) == [0, 1, 2]
    assert m._runnable([0, 1, 2, 3], 2) == [0, 1, 2, 3]  # 4 + 2 newcomers: 6
    assert m._runnable([0, 1, 2], 0) == [0, 1, 2]
    m.usable = lambda n: n == 7
    assert m._runnable([0, 1, 2], 0) == [0, 1, 2]


def test_one_worker_speaks_for_each_machine() -> None:
    """A generation's lines (failed, go on, joined) are said once per machine: by the lowest id of this worker's
    machine among the members, the lost left out (ids in blocks of the machine's size); by every worker when
    that size is unknown. Machine 1 holds workers 2 and 3; worker 2 lost, 3 speaks."""

    def speaks(me: int, members: list[int], without: tuple[int, ...] = (), per_machine: int = 2) -> bool:
        return ms.Membership(None, me, [0, 1, 2, 3, 4, 5], per_machine=per_machine).speaks_for_machine(members, without)

    assert [speaks(me, [0, 1, 2, 3, 4, 5]) for me in range(6)] == [True, False, True, False, True, False]
    assert [speaks(me, [0, 1, 3, 4, 5], (2,)) for me in (0, 1, 3, 4, 5)] == [True, False, True, True, False]
    assert speaks(3, [0, 1, 2, 3], (2,)) and not speaks(3, [0, 1, 2, 3])  # the lost one does not speak for it
    assert speaks(6, [0, 1, 6, 7]) and not speaks(7, [0, 1, 6, 7])  # a newcomer's machine: its lowest id
    assert all(speaks(me, [0, 1, 2, 3], per_machine=0) for me in range(4))
