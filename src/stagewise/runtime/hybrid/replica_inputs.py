"""The first train step's check that the data-parallel replicas were not all given the same batch.

Forgetting :meth:`Pipeline.local_batch` at ``dp > 1`` is otherwise silent: every replica trains the whole
batch, their averaged gradient is the one replica's, the loss the same, for ``r`` times the compute. So on the
first train step, before any message of the schedule, every rank reduces a fingerprint of its micro-batches
(the rank holding stage 0 its inputs', the last stage's its targets') to their maximum and minimum over the
mesh, in one small collective; equal fingerprints on every replica are refused, on every rank alike, with the
fix. Later steps pay nothing.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..engine.given_batches import fingerprint


def refuse_same_inputs(hybrid: Any, inputs: list[Any] | None, targets: list[Any] | None, wait: Any) -> None:
    """Every rank: refuse when every data-parallel replica holds the same first batch (a collective over the mesh,
    of four numbers). ``hybrid``: the pipeline's :class:`~.hybrid.Hybrid`."""
    config = hybrid.config
    if config.replicas <= 1:
        return
    slots = []
    for f in (fingerprint(inputs), fingerprint(targets)):
        slots += [-math.inf, -math.inf] if f is None or not math.isfinite(f) else [f, -f]
    t = torch.tensor(slots, dtype=torch.float64, device=hybrid.mesh.device_type)
    hybrid.mesh.all_reduce(t, ("pp", "dp", "sharding", "tp"), "max", wait=wait, what="the replicas' first inputs")
    high_in, low_in, high_tg, low_tg = t.tolist()
    seen = [(h, -low) for h, low in ((high_in, low_in), (high_tg, low_tg)) if h > -math.inf]
    if seen and all(h == low for h, low in seen):
        raise ValueError(
            f"the {config.replicas} data-parallel replicas (dp={config.dp} x sharding={config.sharding}) were all "
            "given the same batch on their first train step: each would train the whole batch (the same loss, "
            f"{config.replicas} times the compute). Give each replica its share: "
            "pipe.train_step(*pipe.local_batch(inputs, targets)) cuts a global batch, or shard the data over the "
            "replicas (e.g. a DistributedSampler with num_replicas=dp x sharding)"
        )
