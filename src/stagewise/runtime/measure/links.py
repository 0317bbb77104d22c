"""Measure the links of the actual group: a ping-pong between two ranks, inside a node and across two.

Small and bounded: ``rounds`` round trips at two message sizes (8 B and
4 MiB) between one pair of ranks, every exchange bounded by a deadline, so a
missing peer raises a ``PipelineError`` naming the wait instead of hanging. The one-way
time of the small message is the latency; the extra time of the large one
over its extra bytes gives the bandwidth (the alpha-beta model of
:class:`stagewise.planning.Link`). Ranks are taken to be packed onto nodes in order
(``processes_per_node`` consecutive ranks per node), as the planner assumes.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ...planning import Link
from ...planning.comm import cpu_share
from ..comm.coordinator import call_with_deadline
from ..hybrid.data_parallel import GradAverager

T = TypeVar("T")

SMALL, LARGE = 8, 4 << 20  # bytes per message


def _bounded(fn: Callable[[], T], deadline: float, what: str) -> T:
    """``fn()`` on a helper thread, raising if it has not returned by the ``time.monotonic()`` deadline (gloo
    works cannot be polled: see :mod:`stagewise.runtime.comm.faults.waiters`)."""
    return call_with_deadline(fn, max(deadline - time.monotonic(), 0.001), f"the link probe: {what}")


def slowest(seconds: float, deadline: float) -> float:
    """The largest of every rank's ``seconds`` (a collective over the default group)."""
    t = torch.tensor([seconds], dtype=torch.float64)
    _bounded(lambda: dist.all_reduce(t, dist.ReduceOp.MAX), deadline, "the max over ranks")
    return float(t)


def slowest_each(values: list[float], deadline: float) -> list[float]:
    """Each of ``values``, the largest over every rank (a collective over the default group)."""
    t = torch.tensor(values, dtype=torch.float64)
    _bounded(lambda: dist.all_reduce(t, dist.ReduceOp.MAX), deadline, "the max over ranks")
    return [float(x) for x in t]


def average(seconds: float, deadline: float) -> float:
    """The mean of every rank's ``seconds`` (a collective over the default group)."""
    return summed([seconds], deadline)[0] / dist.get_world_size()


def summed(values: list[float], deadline: float) -> list[float]:
    """Each of ``values`` summed over every rank (a collective over the default group)."""
    t = torch.tensor(values, dtype=torch.float64)
    _bounded(lambda: dist.all_reduce(t, dist.ReduceOp.SUM), deadline, "the sums over ranks")
    return [float(x) for x in t]


def _one_way(me: int, peer: int, nbytes: int, rounds: int) -> float:
    """Median one-way seconds for ``nbytes`` between ``me`` and ``peer`` (the lower rank sends first)."""
    buf = torch.zeros(nbytes // 4)
    times = []
    for _ in range(rounds + 1):  # the first round trip sets up the connection: not counted
        started = time.perf_counter()
        order = ("send", "recv") if me < peer else ("recv", "send")
        for op in order:
            (dist.send if op == "send" else dist.recv)(buf, peer)
        times.append((time.perf_counter() - started) / 2)
    return statistics.median(times[1:])


def ping_pong(a: int, b: int, *, rounds: int = 10, timeout: float = 30.0) -> Link:
    """The link between global ranks ``a`` and ``b``, measured by them, returned on every rank (a collective)."""
    deadline = time.monotonic() + timeout
    me = dist.get_rank()
    fit = torch.zeros(2, dtype=torch.float64)
    if me in (a, b):
        peer = b if me == a else a
        what = f"round trips between ranks {me} and {peer}"
        small = _bounded(lambda: _one_way(me, peer, SMALL, rounds), deadline, what)
        large = _bounded(lambda: _one_way(me, peer, LARGE, rounds), deadline, what)
        fit[0] = small
        # noise can hide the latency inside the large message's time: then its whole time bounds the bandwidth
        fit[1] = (LARGE - SMALL) / max(large - small, 0.1 * large, 1e-9)
    _bounded(lambda: dist.broadcast(fit, src=a), deadline, f"the result of rank {a}'s probe")
    return Link(latency=max(float(fit[0]), 0.0), bandwidth=float(fit[1]))


#: bytes of each message :func:`link_cpu` streams (an activation of the benchmarks' GPT at 2 samples: 128 KiB)
STREAM_BYTES = 1 << 17


def link_cpu(a: int, b: int, *, nbytes: int = STREAM_BYTES, rounds: int = 5, timeout: float = 120.0) -> float:
    """The share of a core a message on the link between global ranks ``a`` and ``b`` takes at each end while it
    is on the link (:attr:`stagewise.simulation.CostModel.link_cpu`): both ranks run a fixed compute loop, alone
    and then while ``a`` streams messages of ``nbytes`` to ``b`` for longer than the loop lasts; the share is the
    loop's slowdown (the mean of the two ends, the median of ``rounds``), in [0, 1]. Returned on every rank (a
    collective; the other ranks wait). 2026-12-06, 100 Mbit/s between two machines: the pipeline's compute ran
    26-57 % slower than over a fast link (1F1B to ZB-V at 8 micro-batches, 2 ranks)."""
    world = dist.get_world_size()
    if a == b or not (0 <= a < world and 0 <= b < world):
        raise ValueError(f"link_cpu: a and b must be two ranks of the {world} processes, got {a} and {b}")
    deadline = time.monotonic() + timeout
    me = dist.get_rank()
    got = torch.zeros(1, dtype=torch.float64)
    pair = dist.new_group([a, b])  # every rank makes it
    if me in (a, b):
        got[0] = _bounded(lambda: _stream_share(me == a, b if me == a else a, pair, nbytes, rounds), deadline,
                          f"the compute beside a stream between ranks {a} and {b}")  # fmt: skip
    got[0] = summed([float(got[0])], deadline)[0] / 2
    dist.destroy_process_group(pair)  # (not after a failure: a broken group is dropped, never destroyed)
    return min(max(float(got[0]), 0.0), 1.0)


def _stream_share(sender: bool, peer: int, pair: Any, nbytes: int, rounds: int) -> float:
    """This end's median of (the loop beside the stream / the loop alone - 1) over ``rounds``."""

    def loop(n: int) -> float:
        started = time.perf_counter()
        _compute(n)
        return time.perf_counter() - started

    n = max(1, int(64 / max(loop(64), 1e-6) * 0.2))  # about 0.2 s of compute
    buf = torch.zeros(nbytes // 4)
    dist.barrier(group=pair)
    started = time.perf_counter()  # the link's rate: 8 messages (the first sets up the connection)
    _stream(sender, peer, buf, 8)
    rate = torch.tensor([8 * nbytes / max(time.perf_counter() - started, 1e-9)], dtype=torch.float64)
    dist.all_reduce(rate, dist.ReduceOp.MIN, group=pair)  # the receiver's (a sender returns once it is buffered)
    agreed = torch.tensor([min(4096, max(8, int(1.5 * loop(n) * float(rate) / nbytes)))], dtype=torch.int64)
    dist.all_reduce(agreed, dist.ReduceOp.MAX, group=pair)  # one count at both ends, the longer loop's
    count = int(agreed)
    shares = []
    for _ in range(rounds):
        dist.barrier(group=pair)
        alone = loop(n)
        dist.barrier(group=pair)
        works = _post(sender, peer, buf, count)
        beside = loop(n)
        for work in works:
            work.wait()
        shares.append(beside / alone - 1)
    return statistics.median(shares)


def _compute(n: int) -> None:
    """``n`` rounds of a small layer's work (a 64 x 256 by 256 x 256 product and a ReLU)."""
    x, w = torch.ones(64, 256), torch.ones(256, 256)
    for _ in range(n):
        torch.mm(x, w).relu_()


def _post(sender: bool, peer: int, buf: torch.Tensor, count: int) -> list[Any]:
    return [(dist.isend if sender else dist.irecv)(buf, peer) for _ in range(count)]


def _stream(sender: bool, peer: int, buf: torch.Tensor, count: int) -> None:
    for work in _post(sender, peer, buf, count):
        work.wait()


def measure_links(nodes: int = 1, *, rounds: int = 10, timeout: float = 30.0) -> tuple[Link | None, Link | None]:
    """``(intra, inter)`` for this group on ``nodes`` nodes: ranks 0-1 inside node 0, ranks 0 and
    ``processes_per_node`` across; None where the shape has no such pair (a collective)."""
    world = dist.get_world_size()
    if nodes < 1 or world % nodes:
        raise ValueError(f"measure_links: nodes must be a positive int dividing the {world} processes, got {nodes}")
    per_node = world // nodes
    intra = ping_pong(0, 1, rounds=rounds, timeout=timeout) if per_node >= 2 else None
    inter = ping_pong(0, per_node, rounds=rounds, timeout=timeout) if nodes >= 2 else None
    return intra, inter


#: bytes of the two all-reduces :func:`all_reduce_link` times (stages hold 0.4-13 MB of parameters in the benchmarks)
REDUCE_SIZES = (1 << 20, 1 << 24)


def all_reduce_link(dp: int = 2, *, rounds: int = 5, timeout: float = 60.0, alone: bool = False) -> Link | None:
    """The replicas' all-reduce as a link, ``2 (dp - 1) / dp`` ring shares priced on it: the runtime's SYNC
    (:class:`~stagewise.runtime.hybrid.data_parallel.GradAverager`: the gradients flattened into a bucket, gloo's
    ``all_reduce``, the average and the copy back) timed in every replica group of a ``(world / dp) x dp``
    layout, at two sizes (:data:`REDUCE_SIZES`), the slowest rank's median of ``rounds``; the ring's latency and
    bandwidth solved through the two. A collective over the default group; None where the world cannot hold
    ``dp`` replicas. Gloo's collectives do not use the pipeline's point-to-point transport, whose link the
    calibration fits (a dp 1 plan's run holds no all-reduce at all).

    Every group at once (default): as a plan's SYNCs run, waits on the node's shared cores. ``alone``: each group
    by itself while the others wait at a barrier, its processes on cores of their own where the node has them:
    a SYNC's own seconds where the replicas share a machine, of which the prediction shares the CPU part
    (:func:`all_reduce_cpu`) among the node's processes (``RunCalibrator(reduce_cpu=)``)."""
    medians = _synced_medians(dp, REDUCE_SIZES, rounds, timeout, alone)
    if medians is None:
        return None
    share = 2 * (dp - 1) / dp  # of the bytes each rank sends and receives in a ring
    per_byte = (medians[1] - medians[0]) / (share * (REDUCE_SIZES[1] - REDUCE_SIZES[0]))
    steps = 2 * (dp - 1)  # latencies in a ring
    if per_byte <= 0:
        return Link(latency=max(medians[0], 0.0) / steps, bandwidth=float("inf"))
    return Link(latency=max(medians[0] - share * REDUCE_SIZES[0] * per_byte, 0.0) / steps, bandwidth=1 / per_byte)


def all_reduce_cpu(dp: int = 2, *, sharing: float, rounds: int = 5, timeout: float = 60.0) -> float | None:
    """The share of the replicas' SYNC (:func:`all_reduce_link`'s path) that is CPU work of their machine, the
    rest a wait for the peer: timed at the larger :data:`REDUCE_SIZES` with each replica group alone and with
    every group at once, when ``sharing`` processes contend for each core (a machine's processes over its cores)
    (:func:`~stagewise.planning.comm.cpu_share`). A collective over the default group; None where the world
    cannot hold ``dp`` replicas. 2026-12-06, 4 processes on 2 cores, 13 MB: 18-19 ms alone, 26-31 ms at once:
    about half of it. A SYNC all CPU read ZB-V's two SYNCs at a step's end, all four processes reducing, twice
    as long as they ran (7 % high, ordered behind 1F1B)."""
    alone = _synced_medians(dp, REDUCE_SIZES[-1:], rounds, timeout, True)
    together = _synced_medians(dp, REDUCE_SIZES[-1:], rounds, timeout, False)
    if alone is None or together is None:
        return None
    return cpu_share(alone[0], together[0], sharing)


def _synced_medians(dp: int, sizes: tuple[int, ...], rounds: int, timeout: float, alone: bool) -> list[float] | None:
    """Per size of ``sizes`` (bytes), the slowest rank's median seconds of ``rounds`` of the runtime's SYNC in
    every replica group (:func:`all_reduce_link`); None where the world cannot hold ``dp`` replicas."""
    world = dist.get_world_size()
    if dp < 2 or world % dp:
        return None
    deadline = time.monotonic() + timeout
    pp = world // dp
    groups = [[s * dp + r for r in range(dp)] for s in range(pp)]  # stage s's replicas (dp the innermost axis)
    handles = [dist.new_group(g) for g in groups]  # every rank makes every group, in the same order
    medians = _timed_medians(handles, groups, sizes, rounds, deadline, alone, world)
    for h in handles:  # let them go (not after a failure: a broken group is dropped, never destroyed): a probe
        dist.destroy_process_group(h)  # called again would otherwise keep a group's threads and sockets each time
    return medians


def _timed_medians(
    handles: list[Any],
    groups: list[list[int]],
    sizes: tuple[int, ...],
    rounds: int,
    deadline: float,
    alone: bool,
    world: int,
) -> list[float]:
    """:func:`_synced_medians` on the replica groups made (``handles``, one per group of ``groups``)."""
    rank = dist.get_rank()
    mine = next(h for h, g in zip(handles, groups) if rank in g)
    turns = groups if alone else [list(range(world))]  # who reduces in each timed turn
    medians = []
    for nbytes in sizes:
        weight = torch.nn.Parameter(torch.zeros(nbytes // 4))
        weight.grad = torch.ones(nbytes // 4)
        averager = GradAverager({0: [weight]}, mine)

        def sync(averager: GradAverager = averager) -> None:
            averager.start(0)
            averager.finish(0)

        def timed() -> list[float]:
            sync()  # the group's connections, not counted
            seen = []
            for _ in range(rounds):
                for turn in turns:
                    dist.barrier()  # every group at once (or this turn's), as a plan's SYNCs run
                    if rank not in turn:
                        continue
                    # and the group's ranks together: the world's barrier lets ranks go one by one, a link's delay
                    # apart, and the timed reduce waited for that
                    dist.barrier(group=mine)
                    t0 = time.perf_counter()
                    sync()
                    seen.append(time.perf_counter() - t0)
            return seen

        medians.append(slowest(statistics.median(_bounded(timed, deadline, "the replicas' all-reduce")), deadline))
    return medians
