"""``stagewise run --in-place``'s agent (runtime/elastic/agent.py): its run loop, on a stand-in worker group -
it starts the workers once and never restarts them, whatever happens, and has no exit barrier."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from torch.distributed.elastic.agent.server.api import RunResult, WorkerState

from stagewise.runtime.elastic.agent import agent_class, in_place_agent


class _Agent:
    """What the loop uses of a LocalElasticAgent: the worker group and four methods; ``states`` is what the
    monitor sees, one per look; ``waiting`` how many machines wait to join at each look."""

    def __init__(self, states: list[WorkerState], waiting: int = 0) -> None:
        self.states, self.calls = list(states), []  # type: list[WorkerState], list[str]
        spec = SimpleNamespace(monitor_interval=0, rdzv_handler=SimpleNamespace(num_nodes_waiting=lambda: waiting))
        self._worker_group = SimpleNamespace(spec=spec, state=WorkerState.INIT)

    def _initialize_workers(self, group: Any) -> None:
        self.calls.append("start")
        group.state = WorkerState.HEALTHY

    def _monitor_workers(self, group: Any) -> RunResult:
        return RunResult(state=self.states.pop(0))

    def _stop_workers(self, group: Any) -> None:
        self.calls.append("stop")

    def _restart_workers(self, group: Any) -> None:
        raise AssertionError("an in-place agent never restarts its workers")

    def _exit_barrier(self) -> None:
        raise AssertionError("an in-place agent has no exit barrier")


def _run(agent: _Agent) -> RunResult:
    return agent_class()._invoke_run(agent)  # type: ignore[arg-type]


def test_a_waiting_machine_restarts_nobody_and_success_ends_without_a_barrier(caplog: pytest.LogCaptureFixture) -> None:
    agent = _Agent([WorkerState.HEALTHY, WorkerState.HEALTHY, WorkerState.SUCCEEDED], waiting=1)
    assert _run(agent).state == WorkerState.SUCCEEDED
    assert agent.calls == ["start"]
    assert sum("waits to join" in r.getMessage() for r in caplog.records) == 1  # told once


@pytest.mark.parametrize("state", [WorkerState.FAILED, WorkerState.UNHEALTHY])
def test_a_failed_worker_ends_its_machines_part_without_a_restart(state: WorkerState) -> None:
    agent = _Agent([WorkerState.HEALTHY, state])
    assert _run(agent).state == state
    assert agent.calls == ["start", "stop"] and agent._worker_group.state == WorkerState.FAILED


def test_the_launcher_makes_the_in_place_agent_for_the_run_only() -> None:
    import torch.distributed.launcher.api as launcher

    before = launcher.LocalElasticAgent
    with in_place_agent():
        assert issubclass(launcher.LocalElasticAgent, before) and launcher.LocalElasticAgent is not before
    assert launcher.LocalElasticAgent is before
