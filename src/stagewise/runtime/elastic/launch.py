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
"""

from __future__ import annotations

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
