"""``stagewise run --in-place``: torch's elastic agent, with a loop of stagewise's that never restarts workers.

torch's ``LocalElasticAgent`` (2.13, ``SimpleElasticAgent._invoke_run``) restarts every local worker when
one of them fails, and when a machine waits to join (``num_nodes_waiting() > 0``); a machine that is *lost*
restarts nobody by itself while the survivors' workers stay alive - which in an in-place job
(:class:`stagewise.runtime.InPlace`) they do: they agree on the next generation among themselves, on the store of
``stagewise rendezvous``. What is left for the agent, as DeepSpeed's ``DSElasticAgent`` does it, is its own
``_invoke_run``:

* start this machine's workers once (torch's rendezvous numbers the machines of the first round);
* a worker that ends with a failure ends this machine's part: its other workers are stopped and the agent
  returns the failure - never a restart (the other machines go on without it); but a worker that leaves
  fenced (exit status 3) while another of the machine runs is let go alone (:func:`let_fenced_go`);
* a machine started while its job runs (the job's ``generation`` is on the store of ``stagewise rendezvous``,
  or torch's round is already complete) skips torch's rendezvous, which would wait for a round nobody starts:
  it claims fresh ids for its workers on that store (:func:`.joining.claim_ids`: never a live member's, nor a
  lost or fenced one's) and starts them with ``STAGEWISE_JOIN=1``; they ask to join and the members take them
  in at a step boundary (:mod:`.joining`). Its machine is named by its first id (``GROUP_RANK``), unlike any
  other machine's. Nobody restarts: the members' agents never hear of it;
* a machine waiting in torch's rendezvous (one that missed the first round before its job's first worker
  wrote the generation) restarts nobody: it is told once in the log;
* at the end, no exit barrier: torch's waits for every machine of the first round, the lost ones too
  (``exit_barrier_timeout``, 300 s by default) - the survivors' job is over when their workers are.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from datetime import timedelta
from typing import Any

from . import joining
from . import membership as ms

log = logging.getLogger(__name__)

FENCED_EXIT = 3  # a fenced worker's exit status (sw.runtime.InPlace's)


def agent_class() -> type:
    """The agent class (made on first use: torch's elastic modules load only for ``stagewise run``)."""
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    class InPlaceAgent(LocalElasticAgent):
        """A LocalElasticAgent whose run loop starts the workers once and never restarts them."""

        def _invoke_run(self, role: str = "default") -> Any:
            group = self._worker_group
            spec = group.spec
            store = running_job(spec)
            if store is None:
                self._initialize_workers(group)
            else:
                start_newcomers(self, group, store)
            told = False
            while True:
                time.sleep(spec.monitor_interval)
                let_fenced_go(self)
                result = self._monitor_workers(group)
                group.state = result.state
                if result.state == WorkerState.SUCCEEDED:
                    return result
                if result.state in {WorkerState.UNHEALTHY, WorkerState.FAILED}:
                    self._stop_workers(group)
                    group.state = WorkerState.FAILED
                    return result
                if not told and spec.rdzv_handler.num_nodes_waiting() > 0:
                    told = True
                    log.warning(
                        "stagewise run --in-place: a machine waits to join in torch's rendezvous (it missed the "
                        "first round); this job goes on with its members, nobody is restarted. Start it again: it then "
                        "joins at a step boundary"
                    )

    return InPlaceAgent


def let_fenced_go(agent: Any) -> list[int]:
    """The local ranks whose worker left fenced (exit status :data:`FENCED_EXIT`: stopped or cut off, it woke
    behind its job) while another worker of this machine still runs, taken out of torch's watch: torch's poll
    stops every worker of the machine at the first failure, and the live one is a member of the job. When no
    other worker runs, nothing is taken out (the machine's part ends as a failure, as before). Reads torch's
    ``SubprocessContext`` (private: nothing happens when it differs)."""
    pcontext = getattr(agent, "_pcontext", None)
    handlers = getattr(pcontext, "subprocess_handlers", None)
    running = getattr(pcontext, "_running_local_ranks", None)
    if not isinstance(handlers, dict) or not isinstance(running, set):
        return []
    fenced = [r for r in sorted(running) if r in handlers and handlers[r].proc.poll() == FENCED_EXIT]
    if not fenced or len(fenced) == len(running):
        return []
    running.difference_update(fenced)
    log.warning(
        "stagewise run --in-place: worker(s) %s of this machine left fenced (behind the job's generation); "
        "its other workers go on",
        fenced,
    )
    return fenced


def running_job(spec: Any) -> Any:
    """The job's store when this machine's job already runs (its workers then join it), else None (generation 0:
    torch's rendezvous numbers the machines). No ``STAGEWISE_STORE``: None."""
    where = os.environ.get(ms.STORE_ENV)
    if not where:
        return None
    from ..comm.generations import job_store

    store = job_store(where, spec.rdzv_handler.get_run_id(), 60.0)
    if joining.job_running(store):
        return store
    if _round_complete(spec.rdzv_handler) and not store.check(["ended"]):  # its first workers are starting
        store.wait(["generation"], timedelta(seconds=120))
        return store
    return None


def start_newcomers(agent: Any, group: Any, store: Any) -> None:
    """This machine's workers, started into the running job with fresh ids (see the module doc)."""
    from torch.distributed.elastic.agent.server.api import Worker, WorkerState

    spec = group.spec
    ids = joining.claim_ids(store, spec.local_world_size)
    top = max(ids) + 1  # (a newcomer's WORLD_SIZE means nothing: the job's size is its generation's)
    group.workers = [Worker(local, ids[local], ids[local], top, top) for local in range(spec.local_world_size)]
    group.store, group.group_rank, group.group_world_size = store, ids[0], top
    group.master_addr, group.master_port = "127.0.0.1", 0
    os.environ[joining.JOIN_ENV] = "1"  # the workers inherit the agent's environment
    os.environ[joining.IDS_ENV] = ",".join(map(str, ids))  # they ask together (a size the layout can use)
    log.warning("stagewise run --in-place: the job runs already: this machine's workers %s ask to join it", ids)
    for worker, pid in agent._start_workers(group).items():
        group.workers[worker].id = pid
    group.state = WorkerState.HEALTHY


def _round_complete(handler: Any) -> bool:
    """Whether torch's rendezvous round is complete (a machine joining it now would wait for the next round,
    which an in-place job never starts). torch has no public call for it: False when its internals differ."""
    try:
        handler._state_holder.sync()
        return bool(handler._state_holder.state.complete)
    except Exception:
        return False


@contextmanager
def in_place_agent() -> Iterator[None]:
    """For the launcher's run: torch's launcher makes an :func:`agent_class` instead of its own agent."""
    import torch.distributed.launcher.api as launcher

    before = launcher.LocalElasticAgent
    setattr(launcher, "LocalElasticAgent", agent_class())  # noqa: B010 (a module's class, swapped for the run)
    try:
        yield
    finally:
        setattr(launcher, "LocalElasticAgent", before)  # noqa: B010


@contextmanager
def watched_in_place(*contexts: AbstractContextManager[None]) -> Iterator[None]:
    """Every one of ``contexts`` around the agent's run (the lines of :mod:`.launch`, and this agent)."""
    with ExitStack() as stack:
        for context in contexts:
            stack.enter_context(context)
        yield
