"""The timeline a run records: one event per action, and the CPU seconds of its compute by kind.

This is the format calibration from the run reads (:mod:`..calibration`), the measured timeline is built from
(:func:`.reports.step_timeline`) and the forensics name the last action done from. Frozen: change it only
with its test (tests/runtime/test_timings.py).

``events``: one :class:`ActionEvent` per action run, in the order run. Times are ``time.perf_counter()``
seconds on this rank (not since the step began: :func:`.reports.step_timeline` subtracts the start). A
compute action (F, B, I, W) starts once its input is there (its receive waited for), so a wait for a
neighbour is not in it; it ends when its handler returns (with ``slowdown=``, after the emulated sleep). A
run of sends and receives posted as one batch shares the batch's posting time evenly, in list order. SYNC
and STEP span their handler.

``compute_cpu``: CPU seconds (``time.thread_time``, or ``time.process_time`` when torch's intra-op pool has
more than one thread) spent in compute actions, summed by :class:`~stagewise.ir.Kind`, from the same start
(waits excluded, the emulated sleep excluded): what the planner's per-kind costs predict.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from ...ir import Action, Kind


class ActionEvent(NamedTuple):
    """One action run on this rank: ``(action, start, end)`` in perf_counter seconds (a tuple, unpacks as one)."""

    action: Action
    start: float
    end: float


@dataclass(kw_only=True)
class StepTimings:
    """What a run of an action list recorded: its events in order, its compute's CPU seconds by kind."""

    events: list[ActionEvent] = field(default_factory=list)
    compute_cpu: dict[Kind, float] = field(default_factory=dict)

    def add_compute(self, action: Action, start: float, end: float, cpu: float) -> None:
        """A compute action's event and its CPU seconds (summed into its kind)."""
        self.events.append(ActionEvent(action, start, end))
        self.compute_cpu[action.kind] = self.compute_cpu.get(action.kind, 0.0) + cpu
