"""``sw.calibrate()``: measure on the actual group what the planner's cost model needs beyond a layer profile.

A collective: every rank of the default group calls it, in the same order as
its other collectives. It measures, each step bounded by ``timeout``:

* the links (:func:`stagewise.runtime.measure.links.measure_links`): a ping-pong
  inside a node and, given ``nodes > 1``, across two nodes;
* the runtime's own seconds per stage action and per step: ranks 0 and 1 run a
  pipeline of two ``Linear(1, 1)`` stages (1F1B, nothing to compute) with 2 and
  with 8 one-sample micro-batches; the simulator, with the measured link, a
  cost ``o`` per F and per B and ``c`` per step, is affine in both, so the two
  measured steps give ``o`` and ``c``;
* what each layout costs beyond the model (``layouts``, slowest part): every rank
  runs, for each ``pp x dp x sharding`` factorisation of the group (tp = 1),
  pipelines of ``pp`` stages of 1 and 2 ``Linear(1, 1)`` layers with 2 and 6
  micro-batches per replica; what the planner predicts for each (its action
  costs, transfers, gradient collectives, FSDP2 per unit) is taken off the
  measured step, and the four residuals give that layout's
  :class:`~stagewise.planning.LayoutCost` - the step-end collectives over 4 or 8
  processes and FSDP2's hooks per unit and micro-batch cost what no two-rank or
  one-micro-batch probe shows. Each process's CPU time in those steps, less
  its predicted compute actions, gives the layout's ``cpu`` terms first: the
  CPU of gloo's threads and the step's bookkeeping, which on shared cores is
  taken from every process's compute (at 4 processes on 2 cores, 6-8 ms per
  process per step beside 22-27 ms of compute on the demo GPT);
* the cores a node's processes effectively share: a fixed matrix-multiply loop,
  or the model's own ``workload``, timed on rank 0 alone, then on every rank at once; ``per_node * alone / together``
  (the CPU bound of :mod:`stagewise.planning.costing` with what the machine
  gives, other jobs included, rather than its nominal core count);
* FSDP2's cost per unit and per parameter byte over all ranks
  (:mod:`stagewise.runtime.measure.sharding`), unless ``sharding=False``;
* last, the CPU a process spends idle (:func:`idle_cpu`, ``background``): the
  transport threads of the process groups it holds, the probes' included.

The result is a :class:`stagewise.planning.Calibration` for ``sw.plan(..., calibration=...)``.
The per-message CPU cost stays 0: on a point-to-point link it is part of the
measured latency the simulator already charges per transfer.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ..._util import is_count
from ...planning import Calibration, LayoutCost, Link
from ...schedules import generate
from ...simulation import CostModel, simulate
from ..comm.groups import global_rank, group_size, new_world_subgroup, require_initialized
from .links import average, measure_links, slowest

if TYPE_CHECKING:
    from ..hybrid.mesh import Mesh
    from ..pipeline import Pipeline

_MS = (2, 8)  # micro-batch counts of the trivial pipelines


def calibrate(
    nodes: int = 1,
    *,
    sharding: bool = True,
    layouts: bool = True,
    workload: Callable[[], object] | None = None,
    passes: int = 3,
    timeout: float = 60.0,
) -> Calibration:
    """Measure links, the runtime's cost per action, the cores the node's processes share and (``sharding``)
    FSDP2's cost per unit and (``layouts``) each layout's cost per step; every rank gets it.

    ``workload``: a piece of the model's own work (a forward and backward of some of its layers on a
    micro-batch, say) for measuring the shared cores (:func:`effective_cores`); left out, a small
    matrix-multiply loop, which fits a core's cache and so shares the cores better than most models do.

    ``passes``: each probe runs this many times (the links back to back, the pipelines' steps in interleaved
    passes) and the median of each measured quantity is taken before anything is fitted. With one pass, three
    calls in one run on this project's 2-core VM measured the link latency at 56-698 us, the cost per action at
    46-129 us and one layout's fixed CPU per step at -1.9 to 5.3 ms; ``calibrate()`` takes about ``passes``
    times as long.
    """
    require_initialized()
    if not timeout > 0:
        raise ValueError(f"calibrate: timeout must be > 0 seconds, got {timeout!r}")
    if not is_count(passes):
        raise ValueError(f"calibrate: passes must be an int >= 1, got {passes!r}")
    found = [measure_links(nodes, timeout=timeout) for _ in range(passes)]
    intra, inter = (_median_link([pair[k] for pair in found]) for k in (0, 1))
    world = group_size(None)
    link = intra or inter or Link()
    action, step = action_cost(link, passes=passes, timeout=timeout) if world >= 2 else (0.0, 0.0)
    cores = effective_cores(world // nodes, work=workload, rounds=9 * passes, timeout=timeout)
    cal = Calibration(intra=intra, inter=inter, action=action, step=step, cores=cores)
    if sharding and world >= 2:
        from .sharding import sharding_costs

        fixed, per_byte = sharding_costs(timeout=timeout)
        cal = replace(cal, sharding_fixed=fixed, sharding_per_byte=per_byte, sharding_group=world)
    if layouts and world >= 2:
        cal = replace(cal, layouts=layout_costs(cal, world, nodes, passes=passes, timeout=timeout))
    return replace(cal, background=idle_cpu(timeout=timeout))  # last: with every group the probes left


def _median_link(links: list[Link | None]) -> Link | None:
    """Latency and bandwidth each the median over passes (every pass finds the same pairs, or none)."""
    if links[0] is None:
        return None
    got = [x for x in links if x is not None]
    return Link(
        latency=statistics.median(x.latency for x in got), bandwidth=statistics.median(x.bandwidth for x in got)
    )


def idle_cpu(seconds: float = 0.5, *, timeout: float = 60.0) -> float:
    """CPU seconds per second this process spends while its main thread sleeps, the mean over ranks (a collective).

    Every gloo process group keeps a transport thread that wakes 100 times a second whether or not anything is
    sent; after ``calibrate()`` at 8 ranks a process holds ~43 of them, 4.4 % of a core idle, and on 2 cores
    shared by 8 processes that is a sixth of the machine under every step.
    """
    deadline = time.monotonic() + timeout
    slowest(0.0, deadline)  # everyone idles at once
    started = time.process_time()
    time.sleep(seconds)
    return max(0.0, average((time.process_time() - started) / seconds, deadline))


def action_cost(link: Link, *, steps: int = 20, passes: int = 1, timeout: float = 60.0) -> tuple[float, float]:
    """``(seconds per stage action, seconds per step)`` beyond compute and transfers, from two-rank pipelines of
    trivial layers at two micro-batch counts (each the median over ``passes`` interleaved passes of ``steps``)."""
    pipes = {m: _trivial_pipeline(m, timeout) for m in _MS}
    runs: dict[int, list[float]] = {m: [] for m in _MS}
    for _ in range(passes):
        for m in _MS:
            runs[m].append(slowest(_trivial_step(pipes[m], m, steps), time.monotonic() + timeout))
    for pipe in pipes.values():
        if pipe is not None:
            pipe.transport.close()
    measured = {m: statistics.median(runs[m]) for m in _MS}
    resid, unit = {}, {}
    for m in _MS:
        base, one = _span(m, 0.0, link), _span(m, 1.0, link)
        resid[m], unit[m] = measured[m] - base, one - base
    lo, hi = _MS
    action = max(0.0, (resid[hi] - resid[lo]) / (unit[hi] - unit[lo]))
    step = max(0.0, statistics.mean(resid[m] - action * unit[m] for m in _MS))
    return action, step


def effective_cores(
    per_node: int, *, work: Callable[[], object] | None = None, rounds: int = 9, timeout: float = 60.0
) -> float:
    """How many cores this node's ``per_node`` processes get together: ``per_node * t_alone / t_together``.

    Alone and together alternate, ``rounds`` pairs after a warm-up pair (one pair's ratio ranges 1.6-2.4 for the
    demo GPT's work at 4 processes on 2 cores; the median of 5 moved 1.26-1.86 between runs), and the ratio is the
    median of the pairs': a load that comes and goes then moves both sides of a pair alike, not one side of
    the whole probe.
    ``work`` is what is timed (default: 40 products of a 128 x 128 float64 matrix). What the cores give
    depends on it: processes whose data outgrow their core's cache slow each other down through the shared
    cache and memory, which a cache-resident loop does not show (the demo GPT's forward and backward at 16
    samples costs 1.2x its CPU time alone when 4 processes on 2 cores run it at once; benchmarks/RESULTS.md).
    """
    deadline = time.monotonic() + timeout
    a = torch.randn(128, 128, dtype=torch.float64)

    def default() -> None:
        for _ in range(40):
            a @ a

    run = default if work is None else work

    def timed() -> float:
        started = time.perf_counter()
        run()
        return time.perf_counter() - started

    ratios = []
    for k in range(rounds + 1):
        alone = slowest(timed() if global_rank() == 0 else 0.0, deadline)  # (also the barrier before everyone starts)
        together = slowest(timed(), deadline)
        if k and together > 0:
            ratios.append(alone / together)
    cores = per_node * statistics.median(ratios) if ratios else float(per_node)
    # never more than the processes or the CPUs this process may run on: a noisy 'alone' (a first-call warm-up, a
    # clock boost) must not promise cores the node does not have
    return min(max(cores, 1e-3), per_node, _usable_cpus())


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def layout_costs(
    cal: Calibration, world: int, nodes: int, *, steps: int = 12, passes: int = 1, timeout: float = 60.0
) -> tuple[LayoutCost, ...]:
    """One :class:`LayoutCost` per ``pp x dp x sharding`` factorisation of ``world`` (tp = 1): trivial pipelines of the
    layout at ``u`` layers per stage and ``m`` micro-batches (the corners of :data:`_UNITS` x :data:`_MS_LAYOUT`),
    measured less predicted, solved for the four terms. Each corner's step and CPU are medians over ``passes``
    passes through every layout (a slow spell on the machine then lands on one pass of each, not on one layout)."""
    from ...parallel import ParallelConfig
    from ..hybrid.mesh import build_mesh

    rows = []
    base = replace(cal, step=0.0, layouts=())
    shapes = [(pp, world // pp // sh, sh) for pp in _divisors(world) for sh in _divisors(world // pp)]
    corners = [(u, m) for u in _UNITS for m in _MS_LAYOUT]
    meshes = {shape: build_mesh(ParallelConfig(pp=shape[0], dp=shape[1], tp=1, sharding=shape[2])) for shape in shapes}
    runs: dict[tuple[tuple[int, int, int], tuple[int, int]], list[tuple[float, float]]] = {}
    for _ in range(passes):
        for shape in shapes:  # one mesh per layout: see _layout_step
            for k in corners:
                runs.setdefault((shape, k), []).append(_layout_step(meshes[shape], *k, steps, timeout))
    for pp, dp, sharding in shapes:
        measured = {k: _median_pair(runs[((pp, dp, sharding), k)]) for k in corners}
        # first the CPU the model does not count (measured less the predicted compute actions), then the wall
        # time that the model with that CPU still misses
        hidden = {k: measured[k][1] - _predicted(base, world, nodes, pp, dp, sharding, *k)[1] for k in corners}
        cpu_only = LayoutCost.fit(pp, dp, 1, sharding, dict.fromkeys(corners, 0.0), hidden)
        with_cpu = replace(base, layouts=(cpu_only,))
        wall = {k: measured[k][0] - _predicted(with_cpu, world, nodes, pp, dp, sharding, *k)[0] for k in corners}
        rows.append(LayoutCost.fit(pp, dp, 1, sharding, wall, hidden))
    return tuple(rows)


def _median_pair(pairs: list[tuple[float, float]]) -> tuple[float, float]:
    return statistics.median(a for a, _ in pairs), statistics.median(b for _, b in pairs)


_UNITS = (1, 2)  # layers per stage in the layout probes
_MS_LAYOUT = (2, 6)  # micro-batches per replica in the layout probes


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
    """Medians over ``steps`` of the slowest rank's train step of the trivial pipeline on ``mesh``'s layout and of
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
    x, y = pipe.local_batch(torch.randn(n, 1), torch.randn(n, 1))
    times, cpus = [], []
    for step in range(steps + 2):
        slowest(0.0, deadline)  # everyone starts together, as a timed step in a benchmark does
        started, cpu = time.perf_counter(), time.process_time()
        pipe.train_step(x, y)
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
        elapsed, cpu = slowest(elapsed, deadline), average(cpu, deadline)
        if step >= 2:
            times.append(elapsed)
            cpus.append(cpu)
    pipe.transport.close()
    return statistics.median(times), statistics.median(cpus)


def _span(m: int, o: float, link: Link) -> float:
    """The simulated 1F1B step of two stages, ``m`` micro-batches, cost ``o`` per F and per B, on ``link``."""
    costs = CostModel.uniform(2, forward=o, backward_input=o / 2, backward_weight=o / 2, output_bytes=4)
    return simulate(
        generate("1f1b", 2, m, None), replace(costs, latency=link.latency, bandwidth=link.bandwidth)
    ).makespan


def _trivial_pipeline(m: int, timeout: float) -> Pipeline | None:
    """Ranks 0 and 1: 1F1B over two Linear(1, 1) stages and ``m`` micro-batches; None on the others."""
    from ..pipeline import Pipeline

    member = global_rank() < 2
    group = new_world_subgroup([0, 1])  # (every rank makes it: groups made by their members alone skew later ones)
    if not member:
        return None
    return Pipeline(
        [nn.Linear(1, 1), nn.Linear(1, 1)],
        loss_fn=F.mse_loss,
        schedule="1f1b",
        microbatches=m,
        partition=[1, 1],
        group=group,
        seed=0,
        timeout=timeout,
    )


def _trivial_step(pipe: Pipeline | None, m: int, steps: int) -> float:
    """The median step of ``pipe`` (:func:`_trivial_pipeline`) after two warm-up steps; 0 where it is None."""
    if pipe is None:
        return 0.0
    x, y = torch.randn(m, 1), torch.randn(m, 1)
    times = []
    for step in range(steps + 2):
        started = time.perf_counter()
        pipe.train_step(x, y)
        if step >= 2:  # warm-up
            times.append(time.perf_counter() - started)
    return statistics.median(times)
