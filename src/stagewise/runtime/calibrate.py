"""``sw.calibrate()``: measure on the actual group what the planner's cost model needs beyond a layer profile.

A collective: every rank of the default group calls it, in the same order as
its other collectives. It measures, each step bounded by ``timeout``:

* the links (:func:`stagewise.runtime.comm.probe.measure_links`): a ping-pong
  inside a node and, given ``nodes > 1``, across two nodes;
* the runtime's own seconds per stage action: ranks 0 and 1 run a pipeline of
  two ``Linear(1, 1)`` stages (1F1B, 8 one-sample micro-batches, nothing to
  compute), and the simulator, with the measured link and a cost ``o`` per F
  and per B, is solved for the measured step (it is affine in ``o``);
* FSDP2's cost per unit and per parameter byte over all ranks
  (:mod:`stagewise.runtime.hybrid.probe_sharding`), unless ``sharding=False``.

The result is a :class:`stagewise.Calibration` for ``sw.plan(..., calibration=...)``.
The per-message CPU cost stays 0: on a point-to-point link it is part of the
measured latency the simulator already charges per transfer.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from ..costs import CostModel
from ..planning.calibration import Calibration
from ..planning.comm import Link
from ..schedules import generate
from ..simulate import simulate
from .comm.groups import global_rank, group_size, new_subgroup, require_initialized
from .comm.probe import measure_links, slowest

_M = 8  # micro-batches of the trivial pipeline


def calibrate(nodes: int = 1, *, sharding: bool = True, timeout: float = 60.0) -> Calibration:
    """Measure links, the runtime's cost per action and (``sharding``) FSDP2's cost per unit; every rank gets it."""
    require_initialized()
    if not timeout > 0:
        raise ValueError(f"calibrate: timeout must be > 0 seconds, got {timeout!r}")
    intra, inter = measure_links(nodes, timeout=timeout)
    world = group_size(None)
    link = intra or inter or Link()
    action = action_cost(link, timeout=timeout) if world >= 2 else 0.0
    cal = Calibration(intra=intra, inter=inter, action=action)
    if sharding and world >= 2:
        from .hybrid.probe_sharding import sharding_costs

        fixed, per_byte = sharding_costs(timeout=timeout)
        cal = replace(cal, sharding_fixed=fixed, sharding_per_byte=per_byte, sharding_group=world)
    return cal


def action_cost(link: Link, *, steps: int = 10, timeout: float = 60.0) -> float:
    """Seconds per stage action beyond compute and transfers, from a two-rank pipeline of trivial layers."""
    from .pipeline import Pipeline

    deadline = time.monotonic() + timeout
    member = global_rank() < 2
    group = new_subgroup([0, 1], member)
    elapsed = 0.0
    if member:
        pipe = Pipeline(
            [nn.Linear(1, 1), nn.Linear(1, 1)],
            loss_fn=F.mse_loss,
            schedule="1f1b",
            microbatches=_M,
            partition=[1, 1],
            group=group,
            seed=0,
            timeout=timeout,
        )
        x, y = torch.randn(_M, 1), torch.randn(_M, 1)
        times = []
        for step in range(steps + 2):
            started = time.perf_counter()
            pipe.train_step(x, y)
            if step >= 2:  # warm-up
                times.append(time.perf_counter() - started)
        elapsed = statistics.median(times)
    measured = slowest(elapsed, deadline)
    schedule = generate("1f1b", 2, _M, None)

    def span(o: float) -> float:
        costs = CostModel.uniform(2, forward=o, backward_input=o / 2, backward_weight=o / 2, output_bytes=4)
        return simulate(schedule, replace(costs, latency=link.latency, bandwidth=link.bandwidth)).makespan

    base, unit = span(0.0), span(1.0) - span(0.0)
    return max(0.0, (measured - base) / unit)
