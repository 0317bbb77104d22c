"""The store a process group of one torchrun attempt meets on: torchrun's agent store under the attempt's own prefix.

Under torchrun (c10d rendezvous, and ``--standalone``) every worker's
``env://`` store is a client of the *agent's* store, which lives as long as
the agent, across ``--max-restarts``. torch does not prefix the keys per
attempt (``_create_c10d_store``: "a new TCPStore for every retry", which is
not so when the agent's store is shared), so gloo's full-mesh handshake of
attempt k+1 can read the addresses that attempt k's dead workers published:
"connectFullMesh ... Connection refused", or a wait that ends only at the
timeout. Measured here with torch 2.13, a plain gloo script recovered 2 times
out of 10. The group of each attempt therefore meets under
``stagewise/<run id>/attempt<k>/pg/``, where no earlier attempt wrote.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from .coordinator import torchrun_scope


def attempt_store(timeout: timedelta) -> Any:
    """A prefixed client of the agent's store for this attempt, or None outside torchrun's agent store
    (then ``init_process_group``'s own ``env://`` rendezvous is used)."""
    scope = torchrun_scope()
    if scope is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    client = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        int(os.environ["WORLD_SIZE"]),
        is_master=False,
        timeout=timeout,
    )
    return dist.PrefixStore(f"stagewise/{scope}/pg/", client)
