"""The timeline a run records (:mod:`stagewise.runtime.engine.timings`), pinned: calibration from the run reads it.

``events``: one ``(action, start, end)`` per action run, in order, perf_counter seconds; a compute action
starts once its input is there. ``compute_cpu``: CPU seconds of the compute actions, by kind.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import stagewise as sw
from stagewise.ir import Action, Kind
from stagewise.runtime.engine.timings import ActionEvent, StepTimings


def test_an_event_is_a_named_triple_of_an_action_and_two_perf_counter_seconds() -> None:
    assert ActionEvent._fields == ("action", "start", "end")
    event = ActionEvent(Action(1, Kind.F, 0), 2.0, 3.5)
    action, start, end = event  # a tuple: code reading (a, t0, t1) keeps working
    assert (action, start, end) == (Action(1, Kind.F, 0), 2.0, 3.5) == tuple(event)
    assert [f.name for f in StepTimings.__dataclass_fields__.values()] == ["events", "compute_cpu"]
    timings = StepTimings()
    timings.add_compute(Action(0, Kind.B, 1), 1.0, 2.0, 0.25)
    timings.add_compute(Action(0, Kind.B, 2), 2.0, 3.0, 0.5)
    assert timings.events == [(Action(0, Kind.B, 1), 1.0, 2.0), (Action(0, Kind.B, 2), 2.0, 3.0)]
    assert timings.compute_cpu == {Kind.B: 0.75}


def _pipe(schedule: str, v: int) -> sw.Pipeline:
    layers = [sw.Layer(nn.Linear, 8, 8, dtype=torch.float64) for _ in range(4)]
    return sw.Pipeline(layers, loss_fn=F.mse_loss, schedule=schedule, microbatches=2, virtual_stages=v)


@pytest.mark.parametrize("schedule,v", [("interleaved-1f1b", 2), ("zb-h1", 1)])
def test_a_step_records_every_action_in_order_on_the_perf_counter_and_cpu_by_kind(one_rank, schedule, v) -> None:
    pipe = _pipe(schedule, v)
    x, y = torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64)
    before = time.perf_counter()
    pipe.train_step(x, y)
    after = time.perf_counter()
    record = pipe.last_step
    assert isinstance(record, StepTimings)
    assert all(isinstance(e, ActionEvent) for e in record.events)
    assert [e.action for e in record.events] == list(pipe.schedule.ranks[0])
    assert all(before <= e.start <= e.end <= after for e in record.events)
    assert all(a.end <= b.start for a, b in zip(record.events, record.events[1:]))  # one after another
    kinds = {a.kind for a in pipe.schedule.ranks[0] if a.kind.is_compute}
    assert set(record.compute_cpu) == kinds, schedule
    assert all(seconds > 0.0 for seconds in record.compute_cpu.values())


def test_a_compute_action_starts_once_its_input_is_there(one_rank, monkeypatch) -> None:
    """A wait for the input (here a slow hand-over between local stages) is not in the action's time."""
    from stagewise.runtime.engine.interpreter import Interpreter

    taken: dict[Action, float] = {}
    real = Interpreter.take

    def slow_take(self: Interpreter, run, msg):  # type: ignore[no-untyped-def]
        value = real(self, run, msg)
        time.sleep(0.002)
        taken[run.current] = time.perf_counter()
        return value

    monkeypatch.setattr(Interpreter, "take", slow_take)
    pipe = _pipe("interleaved-1f1b", 2)
    pipe.train_step(torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64))
    events = {e.action: e for e in pipe.last_step.events}
    assert taken and {a.kind for a in taken} >= {Kind.F, Kind.B}
    for action, at in taken.items():
        assert events[action].start >= at, action
