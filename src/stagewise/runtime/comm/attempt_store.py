"""The store a process group of one torchrun job meets on: the agent's store, under keys no earlier job wrote.

Under torchrun (c10d rendezvous, and ``--standalone``) every worker's
``env://`` store is a client of the *agent's* store, which lives as long as
the agent, across ``--max-restarts`` - or longer: a rendezvous store hosted
apart from the agents (``--rdzv-conf=is_host=false`` on every node) outlives
its jobs. torch does not prefix the keys per attempt (``_create_c10d_store``:
"a new TCPStore for every retry", which is not so when the agent's store is
shared), so gloo's full-mesh handshake of attempt k+1 can read the addresses
that attempt k's dead workers published: "connectFullMesh ... Connection
refused", or a wait that ends only at the timeout. Measured here with torch
2.13, a plain gloo script recovered 2 times out of 10. A prefix per attempt
(``<run id>/attempt<k>``) is not enough either: a job that reuses the run id
on a store that outlived the last one meets the same keys again; and under
``--nnodes MIN:MAX`` the restart count is each agent's own (a restart for a
change of membership is not counted), so the workers of one round may not
even agree on ``k``.

So the ranks first agree on a nonce drawn by global rank 0, through the store
(:func:`elect`), in a way that stale keys cannot fool: each rank asks under a
token it has just drawn, and rank 0 answers under that token. The group then
meets under ``stagewise/<run id>/<nonce>/pg/``, and the nonce
scopes every key stagewise writes for the run (:mod:`.coordinator`).
"""

from __future__ import annotations

import os
import secrets
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ..errors import PipelineError
from .coordinator import adopt_nonce, torchrun_scope

_POLL_S = 0.02


def attempt_store(timeout: timedelta) -> Any:
    """A prefixed client of the agent's store for this job, or None outside torchrun's agent store
    (then ``init_process_group``'s own ``env://`` rendezvous is used)."""
    scope = torchrun_scope()
    if scope is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    world = int(os.environ["WORLD_SIZE"])
    client = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False, timeout=timeout
    )
    where = dist.PrefixStore(f"stagewise/{scope}/elect/", client)
    nonce = elect(where, int(os.environ["RANK"]), world, timeout.total_seconds())
    adopt_nonce(nonce)
    return dist.PrefixStore(f"stagewise/{scope}/{nonce}/pg/", client)


def elect(store: Any, rank: int, world: int, timeout: float) -> str:
    """Global rank 0's fresh nonce, on every rank, through ``store`` (which may hold an earlier job's keys).

    Rank ``k`` draws a token ``t``, writes it at ``hello/k`` and waits for ``ack/k/t``: a key no earlier job
    can have written. Rank 0 answers every ``hello/k`` it reads with its nonce ``N`` at ``ack/k/<what it
    read>`` (a stale hello gets an answer nobody waits for) until each rank has confirmed at ``got/t/N`` -
    again a key only this job can write. A barrier, like the group's own rendezvous that follows it.
    """
    started = time.monotonic()
    if rank != 0:
        token = secrets.token_hex(8)
        store.set(f"hello/{rank}", token)
        try:
            store.wait([f"ack/{rank}/{token}"], timedelta(seconds=timeout))
        except Exception as err:
            raise PipelineError(
                f"global rank {rank} waited {timeout:g} s for global rank 0 to answer at the store "
                f"(the run's nonce); is rank 0 running? ({type(err).__name__}: {err})"
            ) from err
        nonce = store.get(f"ack/{rank}/{token}").decode()
        store.set(f"got/{token}/{nonce}", "1")
        return str(nonce)
    nonce = secrets.token_hex(8)
    pending = set(range(1, world))
    answered: dict[int, str] = {}
    while pending:
        for k in sorted(pending):
            if not store.check([f"hello/{k}"]):
                continue
            token = store.get(f"hello/{k}").decode()
            if answered.get(k) != token:
                store.set(f"ack/{k}/{token}", nonce)
                answered[k] = token
            if store.check([f"got/{token}/{nonce}"]):
                pending.discard(k)
        if pending and time.monotonic() - started > timeout:
            missing = ", ".join(map(str, sorted(pending)))
            raise PipelineError(f"global rank 0 waited {timeout:g} s for global ranks {missing} to join the run")
        if pending:
            time.sleep(_POLL_S)
    return nonce
