"""``stagewise run --nnodes MIN:MAX``: what torch's elastic agent is given, and what its rendezvous failures mean.

torch's agent and c10d rendezvous do the work (:mod:`torch.distributed.elastic`): a machine lost for good
makes its peers' workers fail, their agents meet again without it, and every worker starts again at the
new world size; a machine that starts later is taken in at the next round. Two things stagewise sets:

* **A fresh store for each round's workers.** By default torch 2.13 lets the workers of every round meet
  in one long-lived store, hosted by the agent that was rendezvous rank 0 at the *first* round
  (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE`` unset). After a machine is lost, the restarted workers read the
  addresses that the dead round's workers published there: gloo's full mesh then fails with
  "connectFullMesh ... Connection refused" to a worker that no longer exists. Why the keys are stale:
  ``env://`` adds no prefix per round under the agent's store, and even a prefix per restart count would
  not do, since each agent counts only the restarts its own workers' failure caused - the agents whose
  workers were restarted for the change of membership keep the old count. And an agent that was not rank 0
  at the first round keeps the first round's store address for good, so if rank 0's machine is the one
  lost, it would point its workers at a store that is gone. With
  ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` every round's global rank 0 worker hosts a new store (at its
  machine's ``--local-addr``), announced through the rendezvous: no stale key can exist.
* **Ranks by arithmetic.** Every machine runs the same ``-n``, so a worker's global rank is its machine's
  rendezvous rank times ``-n`` plus its local rank (``TORCH_ELASTIC_WORKER_IDENTICAL=1``), with no
  exchange through the store. torch's other way - each agent posts its size, rendezvous rank 0 reads them
  all - was seen to wait a minute for an agent that had moved on to the next round when machines joined in
  quick succession, then end the job (``DistStoreError: wait timeout ... role_info``).
* **The sizes the job may take** (``STAGEWISE_NNODES=MIN:MAX``): :func:`stagewise.init` turns it into
  ``env.world_sizes`` (``-n`` times MIN..MAX), so that ``ElasticLayout.at(env)`` refuses at the start a size
  the job could reach only later, after a loss.
* **A lost machine noticed within seconds** (:data:`FAST_RDZV`, unless ``--rdzv-conf`` says otherwise): torch's
  defaults (a keep-alive every 5 s, 3 missed; a last call of 30 s) made the survivors wait 40 s in silence.
* **One line when the rendezvous itself fails** (:func:`rendezvous_failure`): fewer machines than MIN
  within ``join_timeout``, or the rendezvous store gone with the machine that hosted it.
* **No C++ warnings of a lost store on the console** (:func:`store_warnings_filed`): the workers' stderr reaches
  it through the launcher, which files torch's TCP store client warnings (raised again in Python anyway) with the
  tracebacks; the launcher's own, while its rendezvous calls run, too (the rendezvous host's machine lost).
"""

from __future__ import annotations

import logging
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ...parallel import NNODES_ENV

#: the agent's environment under ``--nnodes MIN:MAX`` (inherited by every worker it starts)
ELASTIC_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "TORCH_ELASTIC_WORKER_IDENTICAL": "1"}
#: the rendezvous settings of ``--nnodes MIN:MAX`` that ``--rdzv-conf`` does not set: a machine whose agent is
#: silent for 3 keep-alives of 1 s is lost; a round closes 2 s after MIN machines met (torch: 5 s x 3, 30 s)
FAST_RDZV = {"keep_alive_interval": "1", "keep_alive_max_attempt": "3", "last_call_timeout": "2"}


def elastic_env(low: int, high: int) -> dict[str, str]:
    """What ``stagewise run --nnodes MIN:MAX`` puts in the agent's environment (and so in every worker's)."""
    return {**ELASTIC_ENV, NNODES_ENV: f"{low}:{high}"}


_GUIDE = "docs/guides/elastic.md"


def rendezvous_failure(err: BaseException, endpoint: str, nodes: tuple[int, int, bool], conf: str = "") -> str:
    """What a failed rendezvous means and what to do, on one line (``err``: torch's ``RendezvousError``;
    ``nodes``: ``--nnodes`` as (MIN, MAX, ...); ``conf``: ``--rdzv-conf``, for the join timeout it set)."""
    where = f"the rendezvous store at {endpoint}"
    low, high = nodes[0], nodes[1]
    kind = type(err).__name__
    cause = " ".join(str(err).split()) or kind
    if kind == "RendezvousTimeoutError":
        timeout = dict(item.split("=", 1) for item in conf.split(",") if "=" in item).get("join_timeout", "600")
        return (
            f"fewer than {low} machines (--nnodes {low}:{high}) joined {where} within join_timeout={timeout} s: "
            f"the job needs {low} at least and cannot go on. Start the missing machines with the same command, or "
            f"restart with a smaller MIN: training resumes from the newest snapshot or checkpoint ({kind})"
        )
    if kind == "RendezvousConnectionError":
        return (
            f"{where} is unreachable: the machine that hosted it is lost (or it never started), and the job cannot "
            f"meet again without it. Restart every machine's command (training resumes from the newest snapshot or "
            f"checkpoint); host the store where no worker runs - `stagewise rendezvous --port PORT` on a machine "
            f"that stays up - so that losing a worker machine cannot take it along (see {_GUIDE}) ({kind}: {cause})"
        )
    if kind == "RendezvousClosedError":
        return (
            f"{where} is closed: another machine ended the job - it finished, failed for good, or gave up waiting "
            f"for {low} machines - before this one could join ({kind})"
        )
    return f"{where}: the rendezvous failed ({kind}: {cause})"


_SILENT = re.compile(r"global ranks? ([\d, ]+) stopped or died")


def failure_line(records: list[dict[str, Any]], nproc: int, left: int, conf: dict[str, str], traces: str) -> str:
    """What a machine prints when its workers failed and restart (``records``: what they left,
    :func:`stagewise.runtime.interrupt.failed`; ``left``: restarts left; ``conf``: the rendezvous settings)."""
    own = [r for r in records if str(r["message"]).startswith(f"rank {r['rank']}:")]  # not relayed from another
    first = (own or records or [{"rank": "?", "steps": "?", "message": "a worker failed"}])[0]
    silent = sorted({int(r) for rec in records for m in [_SILENT.search(rec["message"])] if m for r in m[1].split(",")})
    alive = float(conf.get("keep_alive_interval", 5)) * float(conf.get("keep_alive_max_attempt", 3))
    soon = f"about {alive + float(conf.get('last_call_timeout', 30)) + 5:.0f} s"
    local = f"this machine's {nproc} process{'es' if nproc > 1 else ''}"
    then = f"{local} restart{'s' if nproc == 1 else ''} once the machines meet again"
    if silent:
        machines = sorted({r // nproc for r in silent})
        which = ", ".join(map(str, machines))
        ranks = _ranks(silent)
        head = f"lost machine{'s' if len(machines) > 1 else ''} {which} ({ranks}) after step {first['steps']}"
        how = f"{then} without it (a silent machine is noticed in {alive:g} s: {soon})"
    else:
        head = f"{first['message']} (after step {first['steps']})"
        how = f"{then} ({soon})"
    return (
        f"{head}: {how}, resuming from the newest snapshot or checkpoint ({left} restart{'s' if left != 1 else ''} "
        f"left); tracebacks: {traces}"
    )


def _ranks(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))


def refused(records: list[dict[str, Any]], ranks: list[int]) -> bool:
    """Whether every one of ``ranks`` (this machine's) left with a refusal before its first step."""
    by_rank = {r["rank"]: r for r in records}
    return bool(ranks) and all(by_rank.get(r, {}).get("refusal") for r in ranks)


@contextmanager
def watched(folder: str, nproc: int, conf: dict[str, str], traces: str) -> Iterator[None]:
    """While torch's agent runs, each restart of this machine's workers is one line instead of torch's log:
    their failure (:func:`failure_line`) or a machine that joins; and when every one of them refused before its
    first step, no restart (a refusal would only repeat); and the workers' stderr without torch's store warnings
    (:func:`store_warnings_filed`). The agent's monitor and restart are wrapped for the duration (torch has no
    hook for either)."""
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    from ..interrupt import failed

    monitor, restart = LocalElasticAgent._monitor_workers, LocalElasticAgent._restart_workers
    quiet = _Quiet()
    os.makedirs(traces, exist_ok=True)

    def records(agent: Any, group: Any, counted: bool = False) -> tuple[int, list[dict[str, Any]]]:
        """The attempt of the workers that ran (``counted``: the agent has counted this failure already)."""
        attempt = group.spec.max_restarts - agent._remaining_restarts - int(counted)
        return attempt, _settled(lambda: failed(folder, attempt), [w.global_rank for w in group.workers])

    def watch(agent: Any, group: Any) -> Any:
        result = monitor(agent, group)
        if result.state in {WorkerState.FAILED, WorkerState.UNHEALTHY}:
            attempt, found = records(agent, group)
            if refused(found, [w.global_rank for w in group.workers]):
                agent._remaining_restarts = 0
                _say(f"every process failed before its first step: not restarted (a refusal repeats at every "
                     f"restart); tracebacks: {traces}/attempt-{attempt}")  # fmt: skip
        return result

    def restarting(agent: Any, group: Any) -> Any:
        failure = group.state in {WorkerState.FAILED, WorkerState.UNHEALTHY}  # else: a machine joins
        attempt, found = records(agent, group, counted=failure)
        if found:
            left = agent._remaining_restarts
            _say(failure_line(found, nproc, left, conf, f"{traces}/attempt-{attempt}"))
            _consume(folder, attempt)  # a change of membership keeps the count: the next round's are new
        else:
            _say(f"a machine joins: this machine's {nproc} process{'es' if nproc > 1 else ''} restart at the new "
                 f"size, resuming from the newest snapshot or checkpoint")  # fmt: skip
        return restart(agent, group)

    LocalElasticAgent._monitor_workers = watch  # type: ignore[method-assign]
    LocalElasticAgent._restart_workers = restarting  # type: ignore[method-assign]
    quiet.attach()
    try:
        with store_warnings_filed(traces):
            yield
    finally:
        LocalElasticAgent._monitor_workers = monitor  # type: ignore[method-assign]
        LocalElasticAgent._restart_workers = restart  # type: ignore[method-assign]
        quiet.detach()


#: the rendezvous handler's calls that reach its store (``_keep_alive``: from its keep-alive thread, every second)
_STORE_CALLS = ("next_rendezvous", "num_nodes_waiting", "is_closed", "set_closed", "shutdown", "_keep_alive")


@contextmanager
def store_warnings_filed(traces: str) -> Iterator[None]:
    """Each start of this machine's workers gives them a pipe of :class:`.console.Console` as stderr, whose store
    warnings go to their attempt's folder (its number: their restart count); the launcher's own calls to the
    rendezvous store (:data:`_STORE_CALLS`, and the exit barrier) write to one pipe of their own while they run,
    whose store warnings go to ``traces``: its client warns in C++ at every call once the machine that hosted the
    store is lost, or finished first. torch's start and those calls are wrapped for the duration (torch has no hook
    for any of them)."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler as Rendezvous

    from .console import STORE_WARNINGS, Console

    console = Console()

    def starting(start: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(agent: Any, group: Any) -> Any:
            attempt = group.spec.max_restarts - agent._remaining_restarts
            with console.routed(Path(traces) / f"attempt-{attempt}" / STORE_WARNINGS):
                return start(agent, group)

        return wrapped

    def calling(call: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            with console.own(Path(traces) / STORE_WARNINGS):
                return call(*args, **kwargs)

        return wrapped

    wraps: list[tuple[type, str, Callable[[Callable[..., Any]], Callable[..., Any]]]]
    wraps = [(LocalElasticAgent, "_start_workers", starting), (LocalElasticAgent, "_exit_barrier", calling)]
    wraps += [(Rendezvous, name, calling) for name in _STORE_CALLS]
    saved = [(owner, name, owner.__dict__.get(name)) for owner, name, _ in wraps]  # (None: inherited)
    for owner, name, wrap in wraps:
        setattr(owner, name, wrap(getattr(owner, name)))
    try:
        yield
    finally:
        for owner, name, original in saved:
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        console.close()


def _consume(folder: str, attempt: int) -> None:
    for path in Path(folder).glob(f"failed-{attempt}-r*.json"):
        path.unlink(missing_ok=True)


def _settled(read: Callable[[], list[dict[str, Any]]], ranks: list[int], wait: float = 5.0) -> list[dict[str, Any]]:
    """The records once every local rank left one, or ``wait`` seconds passed (a refusal is raised at once
    everywhere; a peer's failure reaches the others within seconds)."""
    deadline = time.monotonic() + wait
    records = read()
    while len({r["rank"] for r in records} & set(ranks)) < len(ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
        records = read()
    return records


def _say(line: str) -> None:
    print(f"stagewise run: {line}", file=sys.stderr, flush=True)


class _Quiet(logging.Filter):
    """Drops torch's agent's own lines about a failure it restarts from (the one line says it all): each
    worker's exit code, the signals sent to the others, "Worker group FAILED ... will restart"; and that a
    keep-alive or the rendezvous' shutdown failed because its store is gone (:data:`GONE`): lost with the machine
    that hosted it, which :func:`rendezvous_failure` says in one line, or finished first (nobody left to tell)."""

    LOGGERS = (
        "torch.distributed.elastic.agent.server.api",
        "torch.distributed.elastic.multiprocessing.api",
        "torch.distributed.elastic.rendezvous.dynamic_rendezvous",
    )
    NOISE = ("failed (exitcode", "closing signal", "Worker group FAILED", "Worker group UNHEALTHY")
    GONE = ("has failed to ", " the rendezvous '", "due to an error of type RendezvousConnectionError")

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not (any(n in text for n in self.NOISE) or all(g in text for g in self.GONE))

    def attach(self) -> None:
        for name in self.LOGGERS:
            logging.getLogger(name).addFilter(self)

    def detach(self) -> None:
        for name in self.LOGGERS:
            logging.getLogger(name).removeFilter(self)
