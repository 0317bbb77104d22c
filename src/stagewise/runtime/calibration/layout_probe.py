"""What each layout costs per step beyond the planner's model of it (``calibrate()``'s slowest part).

Every rank runs, for each ``pp x dp x sharding`` factorisation of the group (tp = 1), pipelines of ``pp``
stages of 1 and 2 ``Linear(1, 1)`` layers with 2 and 6 micro-batches per replica; what the planner predicts
for each (its action costs, transfers, gradient collectives, FSDP2 per unit) is taken off the measured step,
and the four residuals give that layout's :class:`~stagewise.planning.LayoutCost` (see
:mod:`.calibrate`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ...planning import Calibration, LayoutCost
from ..measure.links import slowest, slowest_each, summed

if TYPE_CHECKING:
    from ..hybrid.mesh import Mesh

#: a progress callback: called with what starts next
Tick = Callable[[str], None]


def layout_shapes(world: int) -> list[tuple[int, int, int]]:
    """Every ``(pp, dp, sharding)`` factorisation of ``world`` (tp = 1), as :func:`layout_costs` probes them."""
    return [(pp, world // pp // sh, sh) for pp in _divisors(world) for sh in _divisors(world // pp)]


def layout_costs(
    cal: Calibration,
    world: int,
    nodes: int,
    *,
    steps: int = 12,
    passes: int = 1,
    timeout: float = 60.0,
    tick: Tick | None = None,
) -> tuple[LayoutCost, ...]:
    """One :class:`LayoutCost` per ``pp x dp x sharding`` factorisation of ``world`` (tp = 1): trivial pipelines of the
    layout at ``u`` layers per stage and ``m`` micro-batches (the corners of :data:`_UNITS` x :data:`_MS_LAYOUT`),
    measured less predicted, solved for the four terms. Each corner's step and CPU are medians over ``passes``
    passes through every layout (a slow spell on the machine then lands on one pass of each, not on one layout)."""
    from ...parallel import ParallelConfig
    from ..hybrid.mesh import build_mesh

    rows = []
    base = replace(cal, step=0.0, layouts=())
    shapes = layout_shapes(world)
    corners = CORNERS
    meshes = {shape: build_mesh(ParallelConfig(pp=shape[0], dp=shape[1], tp=1, sharding=shape[2])) for shape in shapes}
    runs: dict[tuple[tuple[int, int, int], tuple[int, int]], list[tuple[float, float]]] = {}
    for n in range(passes):
        for shape in shapes:  # one mesh per layout: see _layout_step
            for k in corners:
                if tick is not None:
                    tick(f"layout pp={shape[0]} dp={shape[1]} sharding={shape[2]}, u={k[0]} m={k[1]}, pass {n + 1}")
                runs.setdefault((shape, k), []).append(_layout_step(meshes[shape], *k, steps, timeout))
    for pp, dp, sharding in shapes:
        measured = {k: _median_pair(runs[((pp, dp, sharding), k)]) for k in corners}
        # first the CPU the model does not count (measured less the predicted compute actions), then the wall
        # time that the model with that CPU still misses
        # FSDP2's hooks per unit and micro-batch, when measured on their own, are in the prediction: no cross term
        cross = cal.sharding_hooks is None
        hidden = {k: measured[k][1] - _predicted(base, world, nodes, pp, dp, sharding, *k)[1] for k in corners}
        cpu_only = LayoutCost.fit(pp, dp, 1, sharding, dict.fromkeys(corners, 0.0), hidden, cross)
        with_cpu = replace(base, layouts=(cpu_only,))
        wall = {k: measured[k][0] - _predicted(with_cpu, world, nodes, pp, dp, sharding, *k)[0] for k in corners}
        rows.append(LayoutCost.fit(pp, dp, 1, sharding, wall, hidden, cross))
    return tuple(rows)


def _median_pair(pairs: list[tuple[float, float]]) -> tuple[float, float]:
    return statistics.median(a for a, _ in pairs), statistics.median(b for _, b in pairs)


_UNITS = (1, 2)  # layers per stage in the layout probes
_MS_LAYOUT = (2, 6)  # micro-batches per replica in the layout probes
CORNERS = [(u, m) for u in _UNITS for m in _MS_LAYOUT]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _predicted(
    cal: Calibration, world: int, nodes: int, pp: int, dp: int, sharding: int, u: int, m: int
) -> tuple[float, float]:
    """What the planner predicts for the probe pipeline (its layers cost nothing but their actions and transfers):
    ``(step time, compute per process)``."""
    from ...partition import LayerCost, LayerProfile
    from ...planning import search

    layer = LayerCost("probe", 1e-9, 5e-10, 5e-10, 1e-9, 4.0, 0.0, 8.0, 4.0)  # equal, so the cut is u per stage
    profile = LayerProfile(
        layers=tuple(replace(layer, name=f"probe{k}") for k in range(pp * u)), device="cpu", repeats=1, warmup=0
    )
    plans = search(
        profile,
        world,
        nodes=nodes,
        global_batch=m * dp * sharding,
        profile_batch=1,
        schedules=["1f1b"],
        max_virtual_stages=1,
        calibration=cal,
        top=100_000,
    ).plans
    for p in plans:
        layout = (p.layout.pp, p.layout.dp, p.layout.tp, p.layout.sharding)
        if layout == (pp, dp, 1, sharding) and p.microbatches == m and p.recompute is None:
            return p.step_time, p.breakdown["compute"]
    return 0.0, 0.0


def _layout_step(mesh: Mesh, u: int, m: int, steps: int, timeout: float) -> tuple[float, float]:
    """Medians over ``steps`` of the trivial pipeline's step on ``mesh``'s layout, as the planner predicts a step
    (back to back: the slowest rank's seconds from the end of its previous step, :class:`stagewise.Plan`), and of
    the CPU seconds a process spends in it (all its threads, the mean over ranks).

    The probes of one layout share its mesh, so the calibration leaves one set of process groups per layout.
    A mesh per probe left ~500 gloo threads per process at 8 ranks, whose idle polling took 89 % of a core
    from every later step (benchmarks/RESULTS.md); destroying them is not an option: torch then hands a
    later group the name, and so the stale rendezvous keys, of a destroyed one (hashed names count the live
    groups), and the next ``new_group`` fails with "connection refused".
    """
    from ..pipeline import Pipeline

    config = mesh.config
    pp, dp, sharding = config.pp, config.dp, config.sharding
    deadline = time.monotonic() + timeout
    pipe = Pipeline(
        [nn.Linear(1, 1) for _ in range(pp * u)],
        loss_fn=F.mse_loss,
        schedule="1f1b",
        microbatches=m,
        partition=[u] * pp,
        parallel=mesh,
        seed=0,
        timeout=timeout,
    )
    n = m * dp * sharding
    g = torch.Generator().manual_seed(0)  # one global batch on every rank (engine.given_batches), cut per replica
    x, y = pipe.local_batch(torch.randn(n, 1, generator=g), torch.randn(n, 1, generator=g))
    slowest(0.0, deadline)  # everyone starts together
    for _ in range(2):  # warm-up: the first step learns shapes and builds buffers
        pipe.train_step(x, y)
    times, cpus = [], []
    started, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        pipe.train_step(x, y)
        now, cpu_now = time.perf_counter(), time.process_time()
        times.append(now - started)
        cpus.append(cpu_now - cpu)
        started, cpu = now, cpu_now
    pipe.transport.close()
    world = mesh.config.world_size
    walls = slowest_each(times, deadline)
    spent = [x / world for x in summed(cpus, deadline)]
    return statistics.median(walls), statistics.median(spent)
