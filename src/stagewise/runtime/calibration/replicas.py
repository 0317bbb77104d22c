"""The replicas' gradient all-reduces, seen from the run, for the link fit (issue 49 item 2): the runtime half.

With ``parallel=ParallelConfig(pp, dp)`` each stage's SYNC starts the reduction of its gradients over the
``dp`` replicas and its STEP waits for it (:mod:`stagewise.runtime.hybrid.hybrid`). Those spans on one
replica include the wait for the slowest replica, so the pure fit
(:func:`stagewise.planning.link_fit.reduce_transfers`) needs every replica's SYNC and STEP on one clock: after
each calibrating step, :meth:`ReplicaSyncs.observe` gathers this rank's over its data-parallel group (a
collective of that group); when the calibration is taken, :meth:`ReplicaSyncs.pairs` turns them into the
all-reduce's per-message (bytes, delay) pairs of this rank's stages and gathers those over the pipeline group,
so that every rank fits the same link. Only a plain data-parallel mesh (no sharding, no tensor parallelism)
is read: there the reduction is the ring the planner prices.
"""

from __future__ import annotations

from typing import Any

from ...ir import Event, Kind, Timeline, parse_action
from ...planning.link_fit import reduce_transfers
from ..comm import collectives

KINDS = (Kind.SYNC, Kind.STEP)


def replica_degree(pipe: Any) -> int:
    """How many replicas reduce each stage's gradients in a ring the planner prices: ``dp`` of a plain
    data-parallel mesh, else 1 (no replicas, or sharded / tensor-parallel ones: left out of the fit)."""
    hybrid = getattr(pipe, "hybrid", None)
    if hybrid is None:
        return 1
    c = hybrid.config
    return int(c.dp) if c.dp > 1 and c.size("sharding") == 1 and c.size("tp") == 1 else 1


class ReplicaSyncs:
    """Every replica's SYNC and STEP events of this rank's stages, per calibrating step (wall-clock seconds)."""

    def __init__(self, pipe: Any) -> None:
        self.pipe = pipe
        self.dp = replica_degree(pipe)
        self.steps: list[list[Timeline]] = []

    def observe(self) -> None:
        """After a calibrating step, on every rank (a collective of its data-parallel group when dp > 1)."""
        if self.dp < 2:
            return
        pipe = self.pipe
        events, _ = pipe.metrics.last_run("train")
        offset = pipe.clock_offset
        mine = [[str(a), t0 + offset, t1 + offset] for a, t0, t1 in events or [] if a.kind in KINDS]
        group = pipe.hybrid.mesh.group("dp")
        everyone = collectives.gather_json(mine, group, pipe.transport.guard.wait, "the replicas' SYNC and STEP")
        rank = pipe.rank
        self.steps.append(
            [
                Timeline("replica", pipe.num_ranks, [Event(rank, parse_action(a), t0, t1) for a, t0, t1 in rows])
                for rows in everyone
            ]
        )

    def pairs(self) -> list[tuple[float, float]]:
        """The all-reduce's (bytes, delay) per message for every stage of the pipeline (a collective of the
        pipeline group when dp > 1; empty otherwise)."""
        if self.dp < 2:
            return []
        reduced = self.pipe.hybrid.reduced_bytes()
        stages = self.pipe.schedule.num_stages
        mine = reduce_transfers(self.steps, [float(reduced.get(s, 0)) for s in range(stages)])
        pipe = self.pipe
        everyone = collectives.gather_json(mine, pipe.transport.group, pipe.transport.guard.wait, "all-reduce delays")
        return [(float(b), float(d)) for rows in everyone for b, d in rows]
