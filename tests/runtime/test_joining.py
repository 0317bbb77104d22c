"""Newcomers joining an in-place elastic job (runtime/elastic/joining.py): one process, a TCPStore, members and
newcomers as threads. Which ids, which step the generation ends after, who is taken in - never how long."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from stagewise.runtime.elastic import joining
from stagewise.runtime.elastic import membership as ms


@pytest.fixture
def host() -> Any:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def _store(host: Any) -> Any:
    client = dist.TCPStore("127.0.0.1", host.port, is_master=False, timeout=timedelta(seconds=20))
    return dist.PrefixStore("job/", client)


def _member(host: Any, me: int, members: list[int]) -> ms.Membership:
    return ms.Membership(_store(host), me, members, silent_s=0.3).start()


def _in_threads(calls: dict[str, Callable[[], Any]]) -> dict[str, Any]:
    got: dict[str, Any] = {}

    def one(name: str, call: Callable[[], Any]) -> None:
        try:
            got[name] = call()
        except Exception as err:  # (what the test reads)
            got[name] = err

    threads = [threading.Thread(target=one, args=item) for item in calls.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return got


def test_ids_are_claimed_above_generation_0_and_never_given_twice(host: Any) -> None:
    people = [_member(host, i, [0, 1, 2]) for i in range(3)]
    got = _in_threads({f"c{k}": (lambda: joining.claim_ids(_store(host), 2)) for k in range(3)})
    ids = sorted(i for v in got.values() for i in v)
    assert ids == [3, 4, 5, 6, 7, 8]  # none of generation 0's (live, lost or fenced), none twice
    people[2].stop()  # a lost member's id stays taken: the next claim is above every id ever given
    assert joining.claim_ids(_store(host), 1) == [9]
    for m in people[:2]:
        m.stop()


def test_the_members_end_the_generation_after_one_agreed_step_whatever_step_they_saw_the_request_at(
    host: Any,
) -> None:
    a, b = joining.Joins(_store(host)), joining.Joins(_store(host))
    assert not a.due(0, 4) and not b.due(0, 4)  # nobody asked: one check each, nothing else
    _store(host).set("gen0/grow", "1")
    # member a sees the request after step 5; member b, a step ahead, after step 6: both end after step 7
    assert [a.due(0, 5), b.due(0, 6), a.due(0, 6), a.due(0, 7), b.due(0, 7)] == [False, False, False, True, True]
    assert a.at == b.at == 5 + joining.MARGIN
    assert not joining.Joins(_store(host)).due(1, 8)  # the next generation's request is its own key


def test_a_newcomer_is_taken_in_at_the_agreed_step_with_the_members(host: Any) -> None:
    people = [_member(host, i, [0, 1]) for i in range(2)]
    new = joining.claim_ids(_store(host), 1)[0]
    steps: dict[int, int] = {}

    def member(m: ms.Membership) -> list[int]:
        joins, step = joining.Joins(m.store), 0
        while True:
            step += 1
            if joins.due(m.generation, step):
                steps[m.me] = step
                return m.next(10.0)
            if step > 500:
                raise AssertionError("no request seen")
            threading.Event().wait(0.01)

    got = _in_threads(
        {
            "0": lambda: member(people[0]),
            "1": lambda: member(people[1]),
            "new": lambda: joining.newcomer(_store(host), new, 10.0, 30.0),
        }
    )
    assert got["0"] == got["1"] == [0, 1, 2], got
    assert got["new"].members == [0, 1, 2] and got["new"].generation == 1 and got["new"].rank == 2
    assert steps[0] == steps[1]  # both ended generation 0 after the same step
    assert people[0].current() == 1
    for m in [*people, got["new"]]:
        m.stop()


def test_a_newcomer_left_out_by_a_loss_agreed_first_is_taken_in_by_the_next_generation(host: Any) -> None:
    people = [_member(host, i, [0, 1, 2]) for i in range(3)]
    people[2].stop()  # machine 2 lost: the survivors agree on generation 1 without it (and without the newcomer)
    got = _in_threads({str(m.me): (lambda m=m: m.next(10.0)) for m in people[:2]})
    assert got == {"0": [0, 1], "1": [0, 1]}
    new = joining.claim_ids(_store(host), 1)[0]
    asked = _in_threads({"new": lambda: joining.ask(_store(host), new, 0.3)})
    assert isinstance(asked["new"], TimeoutError)  # nobody made room yet: it asked generation 1's members
    assert joining.Joins(people[0].store).due(1, 3) is False and _store(host).check(["gen1/grow"])
    got = _in_threads(
        {
            **{str(m.me): (lambda m=m: m.next(10.0)) for m in people[:2]},
            "new": lambda: joining.newcomer(_store(host), new, 10.0, 30.0).members,
        }
    )
    assert got == {"0": [0, 1, 3], "1": [0, 1, 3], "new": [0, 1, 3]}
    for m in people[:2]:
        m.stop()


def test_a_newcomer_still_waiting_when_the_job_ends_leaves(host: Any) -> None:
    people = [_member(host, i, [0]) for i in range(1)]
    _store(host).set("ended", "12")
    with pytest.raises(joining.Ended, match="step 12"):
        joining.ask(_store(host), 1, 30.0)
    assert not joining.job_running(_store(host))
    people[0].stop()


def test_a_newcomer_that_died_before_the_barrier_costs_one_more_generation_without_it(host: Any) -> None:
    people = [_member(host, i, [0, 1]) for i in range(2)]
    store = _store(host)
    store.set("gen1/joiners", "[2]")  # it asked, then died: it never reaches the barrier
    got = _in_threads({str(m.me): (lambda m=m: m.next(1.0)) for m in people})
    assert got == {"0": [0, 1], "1": [0, 1]} and people[0].generation == 2
    assert json.loads(store.get("gen1/members")) == [0, 1, 2]
    for m in people:
        m.stop()


def test_a_machines_newcomers_ask_the_members_to_make_room_only_once_all_of_them_asked(host: Any) -> None:
    people = [_member(host, i, [0, 1]) for i in range(2)]
    first = _in_threads({"3": lambda: joining.ask(_store(host), 3, 0.5, together=[3, 4])})
    assert isinstance(first["3"], TimeoutError)  # it asked alone: a proposal now would take it in alone
    assert not _store(host).check(["gen0/grow"]) and not joining.Joins(_store(host)).due(0, 5)
    got = _in_threads({str(i): (lambda i=i: joining.ask(_store(host), i, 0.5, together=[3, 4])) for i in (3, 4)})
    assert _store(host).check(["gen0/grow"]) and sorted(json.loads(_store(host).get("gen1/joiners"))) == [3, 4], got
    for m in people:
        m.stop()
