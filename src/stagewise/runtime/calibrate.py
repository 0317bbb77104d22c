"""``sw.calibrate()``: measure on the actual group what the planner's cost model needs beyond a layer profile.

A collective: every rank of the default group calls it, in the same order as
its other collectives. It measures, each step bounded by ``timeout``:

* the links (:func:`stagewise.runtime.comm.probe.measure_links`): a ping-pong
  inside a node and, given ``nodes > 1``, across two nodes;
* the runtime's own seconds per stage action and per step: ranks 0 and 1 run a
  pipeline of two ``Linear(1, 1)`` stages (1F1B, nothing to compute) with 2 and
  with 8 one-sample micro-batches; the simulator, with the measured link, a
  cost ``o`` per F and per B and ``c`` per step, is affine in both, so the two
  measured steps give ``o`` and ``c``;
* the cores a node's processes effectively share: a fixed matrix-multiply loop
  timed on rank 0 alone, then on every rank at once; ``per_node * alone / together``
  (the CPU bound of :mod:`stagewise.planning.costing` with what the machine
  gives, other jobs included, rather than its nominal core count);
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

_MS = (2, 8)  # micro-batch counts of the trivial pipelines


def calibrate(nodes: int = 1, *, sharding: bool = True, timeout: float = 60.0) -> Calibration:
    """Measure links, the runtime's cost per action and (``sharding``) FSDP2's cost per unit; every rank gets it."""
    require_initialized()
    if not timeout > 0:
        raise ValueError(f"calibrate: timeout must be > 0 seconds, got {timeout!r}")
    intra, inter = measure_links(nodes, timeout=timeout)
    world = group_size(None)
    link = intra or inter or Link()
    action, step = action_cost(link, timeout=timeout) if world >= 2 else (0.0, 0.0)
    cores = effective_cores(world // nodes, timeout=timeout)
    cal = Calibration(intra=intra, inter=inter, action=action, step=step, cores=cores)
    if sharding and world >= 2:
        from .hybrid.probe_sharding import sharding_costs

        fixed, per_byte = sharding_costs(timeout=timeout)
        cal = replace(cal, sharding_fixed=fixed, sharding_per_byte=per_byte, sharding_group=world)
    return cal


def action_cost(link: Link, *, steps: int = 10, timeout: float = 60.0) -> tuple[float, float]:
    """``(seconds per stage action, seconds per step)`` beyond compute and transfers, from two-rank pipelines of
    trivial layers at two micro-batch counts."""
    deadline = time.monotonic() + timeout
    measured = {m: slowest(_trivial_step(m, steps, timeout), deadline) for m in _MS}
    resid, unit = {}, {}
    for m in _MS:
        base, one = _span(m, 0.0, link), _span(m, 1.0, link)
        resid[m], unit[m] = measured[m] - base, one - base
    lo, hi = _MS
    action = max(0.0, (resid[hi] - resid[lo]) / (unit[hi] - unit[lo]))
    step = max(0.0, statistics.mean(resid[m] - action * unit[m] for m in _MS))
    return action, step


def effective_cores(per_node: int, *, rounds: int = 3, timeout: float = 60.0) -> float:
    """How many cores this node's ``per_node`` processes get together: ``per_node * t_alone / t_together``."""
    deadline = time.monotonic() + timeout
    a = torch.randn(128, 128, dtype=torch.float64)

    def work() -> float:
        started = time.perf_counter()
        for _ in range(40):
            a @ a
        return time.perf_counter() - started

    alone = statistics.median(work() for _ in range(rounds)) if global_rank() == 0 else 0.0
    alone = slowest(alone, deadline)  # (also the barrier before everyone starts)
    together = slowest(statistics.median(work() for _ in range(rounds)), deadline)
    return max(per_node * alone / together, 1e-3) if together > 0 else float(per_node)


def _span(m: int, o: float, link: Link) -> float:
    """The simulated 1F1B step of two stages, ``m`` micro-batches, cost ``o`` per F and per B, on ``link``."""
    costs = CostModel.uniform(2, forward=o, backward_input=o / 2, backward_weight=o / 2, output_bytes=4)
    return simulate(
        generate("1f1b", 2, m, None), replace(costs, latency=link.latency, bandwidth=link.bandwidth)
    ).makespan


def _trivial_step(m: int, steps: int, timeout: float) -> float:
    """Ranks 0 and 1: the median step of 1F1B over two Linear(1, 1) stages and ``m`` micro-batches; others 0."""
    from .pipeline import Pipeline

    member = global_rank() < 2
    group = new_subgroup([0, 1], member)
    if not member:
        return 0.0
    pipe = Pipeline(
        [nn.Linear(1, 1), nn.Linear(1, 1)],
        loss_fn=F.mse_loss,
        schedule="1f1b",
        microbatches=m,
        partition=[1, 1],
        group=group,
        seed=0,
        timeout=timeout,
    )
    x, y = torch.randn(m, 1), torch.randn(m, 1)
    times = []
    for step in range(steps + 2):
        started = time.perf_counter()
        pipe.train_step(x, y)
        if step >= 2:  # warm-up
            times.append(time.perf_counter() - started)
    return statistics.median(times)
