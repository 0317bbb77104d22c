"""Where a chaos run's goodput went (tests/system/scripts/chaos_ledger.py): rows and resume rows written by hand for
a loss and a return in place, and the losses by label, which must add up to everything the run lost."""

from __future__ import annotations

import pytest

import chaos_ledger as cl
import recovery_log as rl

B = 24
RATES = {6: 1.0, 4: 2.0}  # fault-free steps per second


def row(step: int, time: float, world: int, run: str) -> rl.Row:
    return {"step": step, "world": world, "time": time, "samples": [B * (step - 1), B * step], "run": run}


def run_in_place() -> tuple[list[rl.Row], list[rl.Row], list[rl.Event]]:
    """Steps 1-10 at 6 processes (1 s each); a kill at 10.5, seen at 12.0, state back at 14.0 (saved for the
    replay until 14.5); steps 11-45 at 4 (0.5 s each, from 15.0); the machine back at 30.0, the join from 32.0
    to 33.75 (saved until 34.0); steps 46-61 at 6 from 35.0."""
    rows = [row(s, float(s), 6, "g0") for s in range(1, 11)]
    rows += [row(s, 15.0 + 0.5 * (s - 11), 4, "g1") for s in range(11, 46)]
    rows += [row(s, 35.0 + (s - 46), 6, "g2") for s in range(46, 62)]
    lost = {"hold": 0.1, "drop": 0.2, "drop:threads": 0.15, "agree": 0.5, "group": 0.2, "build": 0.5, "resume": 0.3}
    joined = {"commit": 0.25, "drop": 0.125, "agree": 0.125, "group": 0.5, "build": 0.5, "resume": 0.25}
    resumes = [
        {"step": 10, "world": 4, "run": "g1", "time": 14.5, "restored": 14.0, "seconds": 2.0, "parts": lost},
        {"step": 45, "world": 6, "run": "g2", "time": 34.0, "restored": 33.75, "seconds": 1.75, "parts": joined},
    ]
    return rows, resumes, [rl.Event("kill", 1, 10.5, 4), rl.Event("back", 1, 30.0, 6)]


def test_a_loss_and_a_return_in_place_are_cut_where_their_time_went() -> None:
    rows, resumes, events = run_in_place()
    spans = rl.timeline(events, 0.0, 50.0, 6)
    got = cl.ledger(rows, resumes, events, spans, RATES)
    kill, back = got["by_event"]
    assert kill["redone"]["seconds"] == pytest.approx(0.5) and kill["redone"]["lost"] == pytest.approx(0.5)
    assert kill["detect"]["seconds"] == pytest.approx(1.5) and kill["detect"]["lost"] == pytest.approx(3.0)
    assert kill["drop"]["seconds"] == pytest.approx(0.3)  # hold + drop (drop's own parts are inside it)
    assert kill["agree"]["seconds"] == pytest.approx(0.5) and kill["relayout"]["seconds"] == pytest.approx(1.0)
    assert kill["recovery other"]["seconds"] == pytest.approx(0.2)
    assert kill["replay save"]["lost"] == pytest.approx(1.0)
    assert kill["first step"]["lost"] == pytest.approx(0.0)  # 0.5 s: one step at 4, committed
    assert kill["after a change"]["lost"] == pytest.approx(0.0)
    assert back["newcomer start"]["lost"] == pytest.approx(2.0 - 4)  # 2 s at 6 asked, 4 steps done at 4
    assert back["commit"]["seconds"] == pytest.approx(0.25) and back["relayout"]["seconds"] == pytest.approx(1.25)
    assert back["first step"]["lost"] == pytest.approx(0.0)
    labels = got["by_label"]
    assert got["ideal"] == pytest.approx(10.5 + 19.5 * 2 + 20) and got["useful"] == 61
    assert sum(v["lost"] for v in labels.values()) == pytest.approx(got["ideal"] - got["useful"])
    assert sum(v["seconds"] for v in labels.values()) == pytest.approx(50.0)


def test_an_event_not_absorbed_and_a_restart_are_labelled_so() -> None:
    rows = [row(s, float(s), 6, "a") for s in range(1, 11)] + [row(s, 20.0 + s, 4, "b") for s in range(11, 15)]
    events = [rl.Event("stop", 0, 10.5, 4), rl.Event("back", 0, 15.0, 6)]
    spans = rl.timeline(events, 0.0, 40.0, 6)
    got = cl.ledger(rows, [{"step": 10, "world": 4, "run": "b", "time": 30.0}], events, spans, RATES)
    stop, back = got["by_event"]
    assert set(stop) == {"not absorbed"} and stop["not absorbed"]["seconds"] == pytest.approx(4.5)
    assert set(back) == {"not absorbed"}  # no row at 6 before the end
    events = [rl.Event("stop", 0, 10.5, 4)]
    got = cl.ledger(rows, [], events, rl.timeline(events, 0.0, 40.0, 6), RATES)
    assert got["by_event"][0]["recovery (restart)"]["seconds"] == pytest.approx(31.0 - 10.5)
    assert sum(v["lost"] for v in got["by_label"].values()) == pytest.approx(got["ideal"] - got["useful"])
