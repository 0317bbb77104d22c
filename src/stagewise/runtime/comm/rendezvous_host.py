"""``stagewise rendezvous``: torch's rendezvous store (a TCPStore), hosted by a process of its own.

Under ``stagewise run --nnodes MIN:MAX`` every agent reaches torch's c10d rendezvous through one store. If
a training machine hosts it (``--rdzv-host``), losing that machine loses the store, and the survivors can
only exit. Hosted here instead, on a machine that runs no workers (a login node, the Slurm batch host, a
small instance), the store outlives any training machine. It is the same TCPStore torch's agents would
host (multi-tenant, so every agent's and round's client shares it); nothing else runs in this process.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import torch.distributed as dist

log = logging.getLogger(__name__)


def serve(host: str, port: int, stop: threading.Event, ready: Callable[[int], None] | None = None) -> None:
    """Host the store at ``host:port`` until ``stop`` is set (port 0 picks a free one; ``ready`` is told which)."""
    store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False, multi_tenant=True)
    log.info("stagewise rendezvous: hosting the store at %s:%d", host, store.port)
    if ready is not None:
        ready(int(store.port))
    stop.wait()
