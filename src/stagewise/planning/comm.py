"""Communication costs for the planner: links, ring collectives, and which link a mesh axis uses.

A link moves ``bytes`` in ``latency + bytes / bandwidth`` seconds (the
alpha-beta model). Collectives over ``n`` ranks are costed as *rings*
(Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for clusters of
workstations", JPDC 2009; the model NCCL's and gloo's ring algorithms follow):

* reduce-scatter and all-gather of ``S`` bytes: ``n - 1`` steps, each moving
  ``S / n``: ``(n - 1) * (latency + S / (n * bandwidth))``;
* all-reduce = reduce-scatter then all-gather: ``2 (n - 1) * (latency + S / (n * bandwidth))``.

A ring is as slow as its slowest hop, so a group whose ranks are not all on
one node is costed with the inter-node link.

Ranks are numbered as :class:`~stagewise.parallel.ParallelConfig` numbers them
(pp outermost, tp innermost) and packed onto nodes in order: rank ``r`` is on
node ``r // processes_per_node``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..parallel import AXES, ParallelConfig


@dataclass(frozen=True)
class Link:
    """A point-to-point link: ``latency`` seconds per message, ``bandwidth`` bytes per second."""

    latency: float = 0.0
    bandwidth: float = math.inf

    def __post_init__(self) -> None:
        if not 0 <= self.latency < math.inf:
            raise ValueError(f"Link.latency must be a finite number >= 0 seconds, got {self.latency!r}")
        if not self.bandwidth > 0:
            raise ValueError(f"Link.bandwidth must be > 0 bytes/s, got {self.bandwidth!r}")

    def time(self, nbytes: float) -> float:
        return self.latency + nbytes / self.bandwidth


def ring_all_reduce(nbytes: float, n: int, link: Link) -> float:
    """Seconds for a ring all-reduce of ``nbytes`` over ``n`` ranks (0 for one rank or nothing to send)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (n - 1) * (link.latency + nbytes / (n * link.bandwidth))


def cpu_share(alone: float, together: float, sharing: float) -> float:
    """The share of a collective's time that is CPU work: ``alone`` seconds with its processes on cores of their
    own, ``together`` with ``sharing`` processes contending for each core. Its CPU part ``c`` runs ``sharing``
    times slower together, its wait ``w`` does not: ``alone = w + c``, ``together = w + sharing c``, so
    ``c / alone = (together - alone) / ((sharing - 1) alone)``, clipped to [0, 1] (noise can put ``together`` under
    ``alone``). Where nothing contends (``sharing`` at most 1) the split is not seen and matters to no prediction:
    1 (all CPU)."""
    if not alone > 0 or not together >= 0:
        raise ValueError(f"cpu_share: need alone > 0 and together >= 0 seconds, got {alone!r}, {together!r}")
    if sharing <= 1:
        return 1.0
    return min(1.0, max(0.0, (together - alone) / ((sharing - 1) * alone)))


def posted_ring_all_reduce(nbytes: float, n: int, link: Link) -> float:
    """Seconds for a ring all-reduce of ``nbytes`` over ``n`` ranks on a transport that moves a message only once
    its receive is posted (gloo: the receiver's notice crosses the link, then the message does), priced on ``link``
    as the pipeline's own transfers fit it. The pipeline posts each step's receives at its start, a latency ahead
    of the values (:mod:`stagewise.runtime.engine.interpreter`), so its transfers take one latency; a ring's step
    posts its receive as it sends, so each of its ``2 (n - 1)`` steps waits for the notice before the message:
    ``2 (n - 1) * (2 latency + nbytes / (n bandwidth))`` (0 for one rank or nothing to send)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (n - 1) * (2 * link.latency + nbytes / (n * link.bandwidth))


def ring_reduce_scatter(nbytes: float, n: int, link: Link) -> float:
    """Seconds for a ring reduce-scatter (or all-gather) of ``nbytes`` in total over ``n`` ranks."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return (n - 1) * (link.latency + nbytes / (n * link.bandwidth))


ring_all_gather = ring_reduce_scatter


def axis_stride(config: ParallelConfig, axis: str) -> int:
    """Rank distance between neighbours along ``axis`` (tp: 1; pp: dp * sharding * tp)."""
    k = AXES.index(axis)
    stride = 1
    for n in config.shape[k + 1 :]:
        stride *= n
    return stride


def pipeline_nodes(pp: int, processes: int, per_node: int) -> list[int]:
    """Each pipeline rank's node: ranks are packed onto nodes in order, pp outermost, so pipeline rank ``r`` is global
    rank ``r * (processes / pp)`` (its first replica) and sits on node ``r * (processes / pp) // per_node``."""
    group = processes // pp
    return [r * group // per_node for r in range(pp)]


def crosses_nodes(config: ParallelConfig, axis: str, processes_per_node: int) -> bool:
    """Whether some group along ``axis`` has ranks on two nodes (then its ring runs at the inter-node link)."""
    size = config.size(axis)
    if size <= 1:
        return False
    stride = axis_stride(config, axis)
    for first in range(config.world_size):
        if config.coords(first)[AXES.index(axis)] != 0:
            continue
        nodes = {(first + i * stride) // processes_per_node for i in range(size)}
        if len(nodes) > 1:
            return True
        if first >= processes_per_node:  # groups repeat node by node from here on
            break
    return False
