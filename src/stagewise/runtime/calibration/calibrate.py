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
* FSDP2's cost per unit and per parameter byte over all ranks, and its hooks'
  CPU per unit and micro-batch (:mod:`stagewise.runtime.measure.sharding`),
  unless ``sharding=False``;
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
from ...planning import Calibration, Link
from ...planning.core_share import node_cores
from ...schedules import generate
from ...simulation import CostModel, simulate
from ..comm.groups import global_rank, group_size, new_world_subgroup, require_initialized
from ..interrupt import uncounted
from ..measure.cores import node_affinity
from ..measure.links import average, link_cpu, measure_links, slowest
from .layout_probe import CORNERS, Tick, layout_costs, layout_shapes
from .progress import Steps

if TYPE_CHECKING:
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
    progress: bool = True,
) -> Calibration:
    """Measure links, the runtime's cost per action, the cores the node's processes share, (``sharding``) FSDP2's
    cost per unit, (``layouts``) each layout's cost per step and, on ``nodes`` > 1, a message's CPU between nodes
    (:attr:`Calibration.link_cpu`); every rank gets it.

    ``workload``: a piece of the model's own work (a forward and backward of some of its layers on a
    micro-batch, say) for measuring the shared cores (:func:`effective_cores`); left out, a small
    matrix-multiply loop, which fits a core's cache and so shares the cores better than most models do.

    ``passes``: each probe runs this many times (the links back to back, the pipelines' steps in interleaved
    passes) and the median of each measured quantity is taken before anything is fitted. With one pass, three
    calls in one run on a 2-core VM measured the link latency at 56-698 us, the cost per action at
    46-129 us and one layout's fixed CPU per step at -1.9 to 5.3 ms; ``calibrate()`` takes about ``passes``
    times as long (at 8 processes on 2 cores, about 90 s with the default 3). ``progress``: rank 0 draws a bar
    naming the probe under way (rich, on stderr).

    Measuring takes minutes: ``calibrate().save(path)`` keeps it (:meth:`Calibration.save`), for ``Calibration.load``
    or ``stagewise plan --calibration path`` later, on the same group.
    """
    require_initialized()
    if not timeout > 0:
        raise ValueError(f"calibrate: timeout must be > 0 seconds, got {timeout!r}")
    if not is_count(passes):
        raise ValueError(f"calibrate: passes must be an int >= 1, got {passes!r}")
    world = group_size(None)
    pairs = world >= 2
    shapes = layout_shapes(world) if layouts and pairs else []
    total = passes * (2 if pairs else 1) + 2 + (sharding and pairs) + passes * len(shapes) * len(CORNERS)
    total += nodes > 1 and pairs
    with Steps("calibrate", total, progress) as bar, uncounted():  # the probes' steps are not the job's training
        intra, inter = _links(nodes, passes, timeout, bar.next)
        link = intra or inter or Link()
        action, step = action_cost(link, passes=passes, timeout=timeout, tick=bar.next) if pairs else (0.0, 0.0)
        bar.next("the cores the processes share")
        cores = effective_cores(world // nodes, work=workload, rounds=9 * passes, timeout=timeout)
        cal = Calibration(intra=intra, inter=inter, action=action, step=step, cores=cores, processes=world, nodes=nodes)
        if sharding and pairs:
            from ..measure.sharding import hook_cost, sharding_costs

            bar.next("FSDP2's cost per unit")
            fixed, per_byte = sharding_costs(timeout=timeout)
            hooks = hook_cost(timeout=timeout)
            cal = replace(
                cal, sharding_fixed=fixed, sharding_per_byte=per_byte, sharding_group=world, sharding_hooks=hooks
            )
        if shapes:
            cal = replace(cal, layouts=layout_costs(cal, world, nodes, passes=passes, timeout=timeout, tick=bar.next))
        cal = _message_cpu(cal, nodes, timeout, bar.next) if nodes > 1 and pairs else cal
        bar.next("idle CPU")
        return replace(cal, background=idle_cpu(timeout=timeout))  # last: with every group the probes left


def _message_cpu(cal: Calibration, nodes: int, timeout: float, tick: Tick) -> Calibration:
    """``cal`` with the share of a core a message between nodes takes at each end, probed between node 0's first
    rank and node 1's (:func:`~stagewise.runtime.measure.links.link_cpu`)."""
    tick("a message's CPU between nodes")
    return replace(cal, link_cpu=link_cpu(0, group_size(None) // nodes, timeout=timeout))


def _links(nodes: int, passes: int, timeout: float, tick: Tick) -> tuple[Link | None, Link | None]:
    """The links inside a node and between nodes, each the median over ``passes`` ping-pong passes."""
    found = []
    for k in range(passes):
        tick(f"links, pass {k + 1} of {passes}")
        found.append(measure_links(nodes, timeout=timeout))
    intra, inter = (_median_link([pair[k] for pair in found]) for k in (0, 1))
    return intra, inter


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


def action_cost(
    link: Link, *, steps: int = 20, passes: int = 1, timeout: float = 60.0, tick: Tick | None = None
) -> tuple[float, float]:
    """``(seconds per stage action, seconds per step)`` beyond compute and transfers, from two-rank pipelines of
    trivial layers at two micro-batch counts (each the median over ``passes`` interleaved passes of ``steps``).
    ``tick(what)``: called as each pass starts (a progress bar)."""
    pipes = {m: _trivial_pipeline(m, timeout) for m in _MS}
    runs: dict[int, list[float]] = {m: [] for m in _MS}
    for k in range(passes):
        if tick is not None:
            tick(f"the runtime's cost per action, pass {k + 1} of {passes}")
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
    # never more than the processes or the CPUs the node's ranks may run on: a noisy 'alone' (a first-call warm-up,
    # a clock boost) must not promise cores the node does not have; pinned a core each, a rank sees only its own
    return min(max(cores, 1e-3), per_node, _usable_cpus())


def _usable_cpus() -> float:
    """The CPUs any rank on this node may run on (a collective: :func:`~..measure.cores.node_affinity`)."""
    try:
        return node_cores(node_affinity())
    except AttributeError:  # not on Linux: no affinity
        return os.cpu_count() or 1


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
    g = torch.Generator().manual_seed(0)  # one batch on every rank: a pipeline trains one (engine.given_batches)
    x, y = torch.randn(m, 1, generator=g), torch.randn(m, 1, generator=g)
    times = []
    for step in range(steps + 2):
        started = time.perf_counter()
        pipe.train_step(x, y)
        if step >= 2:  # warm-up
            times.append(time.perf_counter() - started)
    return statistics.median(times)
