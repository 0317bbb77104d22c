"""Kept threads for the snapshots' transfers (:mod:`stagewise.runtime.comm.kept_threads`): a free one is reused,
a busy one never holds a task back, an idle one ends, and each task runs at its caller's scheduling policy.
Events, not clocks: a wait's 60 s is a hang guard, never a bound on speed."""

from __future__ import annotations

import os
import threading

import pytest

from stagewise.runtime.comm import kept_threads
from stagewise.runtime.comm.kept_threads import Kept


def _ran(kept: Kept) -> int:
    """Run one task on ``kept`` and return the id of the thread it ran on, once it has become free again."""
    out: dict[str, int] = {}
    done = threading.Event()

    def task() -> None:
        out["tid"] = threading.get_native_id()
        done.set()

    kept.run(task)
    assert done.wait(60)
    for _ in range(6000):  # (the thread counts itself free just after the task: wait for that, not a time)
        with kept._lock:
            if kept._free:
                break
        threading.Event().wait(0.01)
    return out["tid"]


def test_a_free_kept_thread_runs_the_next_task() -> None:
    kept = Kept("test-kept")
    first = _ran(kept)
    assert _ran(kept) == first and _ran(kept) == first
    assert [t.name for t in threading.enumerate()].count("test-kept") == 1


def test_a_busy_thread_holds_no_task_back() -> None:
    """The first task blocks until the second has run: the second must go to a thread of its own."""
    kept = Kept("test-kept-busy")
    release, second = threading.Event(), threading.Event()
    kept.run(lambda: release.wait(60) and None)
    kept.run(second.set)
    assert second.wait(60)
    release.set()


def test_an_idle_kept_thread_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kept_threads, "IDLE_S", 0.01)
    kept = Kept("test-kept-idle")
    _ran(kept)
    alive = [t for t in threading.enumerate() if t.name == "test-kept-idle"]
    for t in alive:
        t.join(60)
    assert not any(t.is_alive() for t in alive) and kept._free == 0


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling policies")
def test_each_task_runs_at_its_callers_policy() -> None:
    """One kept thread, handed a task from a thread at SCHED_IDLE, then from one at the ordinary policy."""
    kept = Kept("test-kept-policy")
    seen: list[tuple[int, int]] = []

    def task() -> None:
        seen.append((threading.get_native_id(), os.sched_getscheduler(0)))

    def caller(policy: int) -> None:
        os.sched_setscheduler(0, policy, os.sched_param(0))
        done = threading.Event()
        kept.run(lambda: (task(), done.set()) and None)
        assert done.wait(60)

    for policy in (os.SCHED_IDLE, os.SCHED_OTHER):
        t = threading.Thread(target=caller, args=(policy,))
        t.start()
        t.join(60)
        for _ in range(6000):
            with kept._lock:
                if kept._free:
                    break
            threading.Event().wait(0.01)
    assert [p for _, p in seen] == [os.SCHED_IDLE, os.SCHED_OTHER] and seen[0][0] == seen[1][0]
