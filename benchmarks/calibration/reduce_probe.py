"""The replicas' all-reduce link, probed before any plan runs (issue 49: the held-out error at 4 processes).

The calibrating plan P is dp 1: its run holds no all-reduce, and the link its transfers calibrate is the
pipeline's point-to-point transport, which gloo's collectives do not use (the kept quiet runs fitted it at
10-37 GB/s; a dp 2 plan's SYNC was priced at 1.5-2 ms for 13 MB while the plans with replicas ran 5-17 % over
the prediction against the plans without). So every rank times gloo's ``all_reduce`` between the replicas of a
``pp x dp 2`` layout, every replica group at once on the node's shared cores as a plan's SYNC runs, at two
sizes, and the ring of two replicas (``2 latency + bytes / bandwidth``) is solved through the two medians (the
slowest rank's). Nothing of a plan Q is measured: this is a probe, like the ping-pong that gives the
point-to-point link its prior bandwidth.
"""

from __future__ import annotations

import math
import statistics
import time

import torch
import torch.distributed as dist

import stagewise as sw

#: bytes of the two all-reduces timed (the workloads' stages hold 0.4-13 MB of parameters)
SIZES = (1 << 20, 1 << 24)


def reduce_link(rounds: int = 5, sizes: tuple[int, int] = SIZES) -> tuple[float, float]:
    """``(latency, bandwidth)`` of the replicas' all-reduce: ``(0, inf)`` for a world that cannot hold two
    replicas or when the larger size is not slower (nothing to fit)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world < 2 or world % 2:
        return 0.0, math.inf
    layout = sw.ParallelConfig(pp=world // 2, dp=2)
    groups = layout.axis_groups("dp")
    handles = [dist.new_group(list(g)) for g in groups]  # every rank makes every group, in the same order
    mine = next(h for h, g in zip(handles, groups) if rank in g)
    medians = []
    for nbytes in sizes:
        t = torch.ones(nbytes // 4)
        dist.all_reduce(t, group=mine)  # warm-up: the group's connections
        seen = []
        for _ in range(rounds):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(t, group=mine)
            seen.append(time.perf_counter() - t0)
        slowest = torch.tensor([statistics.median(seen)], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        medians.append(float(slowest))
    per_byte = (medians[1] - medians[0]) / (sizes[1] - sizes[0])
    if per_byte <= 0:
        return max(medians[0], 0.0) / 2, math.inf
    return max(medians[0] - sizes[0] * per_byte, 0.0) / 2, 1.0 / per_byte
