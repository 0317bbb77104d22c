"""``stagewise run --in-place``'s agent (runtime/elastic/agent.py): its run loop, on a stand-in worker group -
it starts the workers once and never restarts them, whatever happens, and has no exit barrier."""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import pytest
from torch.distributed.elastic.agent.server.api import RunResult, WorkerState

from stagewise.runtime.elastic.agent import agent_class, in_place_agent, let_fenced_go


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


def _handlers(*codes: int | None) -> Any:
    procs = {r: SimpleNamespace(proc=SimpleNamespace(poll=lambda c=c: c)) for r, c in enumerate(codes)}
    return SimpleNamespace(subprocess_handlers=procs, _running_local_ranks=set(procs))


def test_a_fenced_worker_is_let_go_alone_while_another_of_its_machine_runs() -> None:
    """Only one of a machine's workers woke behind the job (fenced, exit 3): torch's poll would stop the other,
    a live member; it is taken out of the watch instead. All fenced, or a real failure: as before."""
    agent = _Agent([WorkerState.HEALTHY, WorkerState.SUCCEEDED])
    agent._pcontext = _handlers(3, None)  # type: ignore[attr-defined]
    assert _run(agent).state == WorkerState.SUCCEEDED and agent.calls == ["start"]
    assert agent._pcontext._running_local_ranks == {1}  # type: ignore[attr-defined]
    for codes in [(3, 3), (1, None), (None, None)]:
        pcontext = _handlers(*codes)
        assert let_fenced_go(SimpleNamespace(_pcontext=pcontext)) == []
        assert pcontext._running_local_ranks == {0, 1}
    assert let_fenced_go(SimpleNamespace()) == []  # (torch's internals differ: nothing)


def test_the_launcher_makes_the_in_place_agent_for_the_run_only() -> None:
    import torch.distributed.launcher.api as launcher

    before = launcher.LocalElasticAgent
    with in_place_agent():
        assert issubclass(launcher.LocalElasticAgent, before) and launcher.LocalElasticAgent is not before
    assert launcher.LocalElasticAgent is before


def _agent_of(job_id: str, nproc: int, started: list[Any]) -> _Agent:
    agent = _Agent([WorkerState.SUCCEEDED])
    spec = agent._worker_group.spec
    spec.rdzv_handler.get_run_id, spec.local_world_size = (lambda: job_id), nproc
    agent._start_workers = lambda group: started.append([w.global_rank for w in group.workers]) or {0: 7, 1: 8}  # type: ignore[attr-defined]
    return agent


def test_a_machine_started_while_its_job_runs_starts_its_workers_into_it_with_fresh_ids(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch.distributed as dist

    from stagewise.runtime.elastic import joining

    host = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("STAGEWISE_STORE", f"127.0.0.1:{host.port}")
    monkeypatch.setenv(joining.JOIN_ENV, "")
    monkeypatch.setenv(joining.IDS_ENV, "")
    job = dist.PrefixStore("stagewise-inplace/j/", host)
    job.set("gen0/members", "[0, 1, 2]")  # generation 0 had ids 0-2; a newcomer took 3 already
    job.set("id/3", "taken")
    started: list[Any] = []
    agent = _agent_of("j", 2, started)
    assert _run(agent).state == WorkerState.SUCCEEDED
    assert agent.calls == ["start"] and started == []  # the job is not running: torch's rendezvous (generation 0)
    job.set("generation", "2")
    agent = _agent_of("j", 2, started)
    assert _run(agent).state == WorkerState.SUCCEEDED
    assert agent.calls == [] and started == [[4, 5]]  # no rendezvous (nobody starts a round); fresh ids
    assert agent._worker_group.group_rank == 4 and os.environ[joining.JOIN_ENV] == "1"
    assert os.environ[joining.IDS_ENV] == "4,5"  # the machine's newcomers ask the members together
