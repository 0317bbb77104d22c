"""``stagewise run --in-place``: torch's elastic agent, with a loop of stagewise's that never restarts workers.

torch's ``LocalElasticAgent`` (2.13, ``SimpleElasticAgent._invoke_run``) restarts every local worker when
one of them fails, and when a machine waits to join (``num_nodes_waiting() > 0``); a machine that is *lost*
restarts nobody by itself while the survivors' workers stay alive - which in an in-place job
(:class:`stagewise.runtime.InPlace`) they do: they agree on the next generation among themselves, on the store of
``stagewise rendezvous``. What is left for the agent, as DeepSpeed's ``DSElasticAgent`` does it, is its own
``_invoke_run``:

* start this machine's workers once (torch's rendezvous numbers the machines of the first round);
* a worker that ends with a failure (or fenced, exit status 3) ends this machine's part: its other workers
  are stopped and the agent returns the failure - never a restart (the other machines go on without it);
* a machine waiting to join restarts nobody: it is told once in the log (joining a running in-place job is
  not built yet; it waits in the rendezvous until the job ends);
* at the end, no exit barrier: torch's waits for every machine of the first round, the lost ones too
  (``exit_barrier_timeout``, 300 s by default) - the survivors' job is over when their workers are.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Any

log = logging.getLogger(__name__)


def agent_class() -> type:
    """The agent class (made on first use: torch's elastic modules load only for ``stagewise run``)."""
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    class InPlaceAgent(LocalElasticAgent):
        """A LocalElasticAgent whose run loop starts the workers once and never restarts them."""

        def _invoke_run(self, role: str = "default") -> Any:
            group = self._worker_group
            spec = group.spec
            self._initialize_workers(group)
            told = False
            while True:
                time.sleep(spec.monitor_interval)
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
                        "stagewise run --in-place: a machine waits to join; this job goes on with its members "
                        "(joining a running in-place job is not supported yet), nobody is restarted"
                    )

    return InPlaceAgent


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
