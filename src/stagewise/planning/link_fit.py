"""The link fitted from the run's own timeline (issue 49 item 2): pure arithmetic, no torch.

A receiving rank that sat idle until a compute action's input arrived shows the transfer's time, from the
producing action's end to the consumer's start (:func:`waited_transfers`). ``latency + bytes / bandwidth`` is
fitted through those delays by least squares (:func:`fit_link`), but only where the run can tell the two
apart: the per-byte cost is *identified* when the transfers carry sizes far enough apart that the fitted slope
stands clear of its own noise (at least :data:`T_MIN` standard errors above zero). A pipeline of equal
blocks (a transformer's) sends one size only: activations forward and their gradients back are the same
tensor shape at every boundary, and a single-replica plan has no all-reduce. Then any bandwidth fits, and the
old fit's choice (infinite, every delay charged per message) made the planner price a plan's bytes at
nothing: an all-reduce of any size cost two latencies. Where the run cannot identify it, the bandwidth is the
prior's (a ping-pong's, :func:`stagewise.runtime.measure.links.ping_pong`, or the caller's), the latency the
median delay less that prior's per-byte cost, and :attr:`LinkFit.note` says so.

A run with replicas (dp > 1) has a second size: each stage's SYNC reduces its gradients (its parameter bytes)
over the ``n`` replicas, a ring all-reduce of ``2 (n - 1)`` messages of ``bytes / n`` each
(:func:`stagewise.planning.comm.ring_all_reduce`). Its span on one replica includes the wait for the slowest
replica, so it gets the point-to-point transfers' "waited" treatment (:func:`reduce_transfers`): the reduction
starts when the last replica's SYNC starts and has ended by the time a replica that waited for it at its STEP
leaves the wait; one message's delay is that interval over ``2 (n - 1)``, and the pair joins the fit.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace

from ..ir import Event, Kind, Schedule, Timeline

COMPUTE = (Kind.F, Kind.B, Kind.I, Kind.W)
#: the slope must stand this many standard errors above zero to be taken as the link's per-byte cost
T_MIN = 2.0


@dataclass(frozen=True)
class LinkFit:
    """The fitted link: ``identified`` when the run's transfers fixed the bandwidth themselves (else the prior's);
    ``transfers`` and ``sizes``: how many waited transfers, of how many distinct sizes; ``note``: one line."""

    latency: float
    bandwidth: float
    identified: bool
    transfers: int
    sizes: int
    note: str


def fit_link(
    timelines: Sequence[Timeline],
    schedule: Schedule,
    output_bytes: Sequence[float],
    prior_bandwidth: float = math.inf,
    reductions: Sequence[tuple[float, float]] = (),
    nodes: Sequence[int] | None = None,
    local: bool = False,
) -> LinkFit:
    """The link through the delays of the transfers a rank waited for (module docstring); ``prior_bandwidth``
    (bytes/s) kept where the delays cannot identify one; ``reductions``: the all-reduces' per-message
    (bytes, delay) pairs (:func:`reduce_transfers`), fitted with the transfers. ``nodes`` (each pipeline rank's):
    only the transfers between two nodes count, or with ``local`` only those inside one (:func:`waited_transfers`)."""
    if not prior_bandwidth > 0:
        raise ValueError(f"fit_link: prior_bandwidth must be > 0 bytes/s, got {prior_bandwidth!r}")
    pairs = [p for timeline in timelines for p in waited_transfers(timeline, schedule, output_bytes, nodes, local)]
    pairs += [(float(b), float(d)) for b, d in reductions]
    sizes = sorted({b for b, _ in pairs})
    if not pairs:
        return LinkFit(0.0, prior_bandwidth, False, 0, 0, f"no waited transfer: {_kept(prior_bandwidth)}")
    slope, intercept = _line(pairs)
    if slope is not None:
        return LinkFit(
            max(0.0, intercept), 1.0 / slope, True, len(pairs), len(sizes),
            f"fitted through {len(pairs)} waited transfers{_of(reductions)} of {len(sizes)} sizes "
            f"({sizes[0]:.0f}-{sizes[-1]:.0f} B)",
        )  # fmt: skip
    latency = max(0.0, statistics.median(d - b / prior_bandwidth for b, d in pairs))
    why = (
        f"one size ({sizes[0]:.0f} B)"
        if len(sizes) == 1
        else f"sizes {sizes[0]:.0f}-{sizes[-1]:.0f} B (slope in the noise)"
    )
    kept = _kept(prior_bandwidth)
    note = f"{len(pairs)} waited transfers{_of(reductions)} of {why}: bandwidth not identified, {kept}"
    return LinkFit(latency, prior_bandwidth, False, len(pairs), len(sizes), note)


def _of(reductions: Sequence[tuple[float, float]]) -> str:
    return f" ({len(reductions)} of them all-reduce messages)" if reductions else ""


def _kept(bandwidth: float) -> str:
    if math.isinf(bandwidth):
        return "no prior bandwidth: infinite (bytes cost nothing)"
    return f"the prior's bandwidth {bandwidth:.3g} B/s kept"


def _line(pairs: list[tuple[float, float]]) -> tuple[float | None, float]:
    """Least squares ``delay = intercept + slope * bytes``; slope None unless it is > 0 by :data:`T_MIN` errors."""
    n = len(pairs)
    mb, md = sum(b for b, _ in pairs) / n, sum(d for _, d in pairs) / n
    sxx = sum((b - mb) ** 2 for b, _ in pairs)
    if n < 3 or sxx <= 0:
        return None, md
    slope = sum((b - mb) * (d - md) for b, d in pairs) / sxx
    intercept = md - slope * mb
    residual = sum((d - intercept - slope * b) ** 2 for b, d in pairs) / (n - 2)
    error = math.sqrt(residual / sxx)
    if slope <= 0 or slope < T_MIN * error:
        return None, md
    return slope, intercept


def waited_transfers(
    timeline: Timeline,
    schedule: Schedule,
    output_bytes: Sequence[float],
    nodes: Sequence[int] | None = None,
    local: bool = False,
) -> list[tuple[float, float]]:
    """(bytes, delay) for each compute action whose input came from another rank while its rank was idle. With
    ``nodes`` (each pipeline rank's node), those whose two ranks are on two nodes, or with ``local`` on one:
    a loopback and a network link are two links, and one fit through both reads neither."""
    placement = schedule.placement
    if nodes is not None and len(nodes) != schedule.num_ranks:
        raise ValueError(
            f"waited_transfers: nodes names {len(nodes)} ranks' nodes, the schedule has {schedule.num_ranks}"
        )
    ends: dict[tuple[Kind, int, int | None], float] = {}
    for e in timeline.events:
        if e.action.kind in COMPUTE:
            ends[(e.action.kind, e.action.stage, e.action.microbatch)] = e.end
    busy_until: dict[int, float] = {}
    out = []
    last = schedule.num_stages - 1
    for e in sorted(timeline.events, key=lambda x: x.start):
        a = e.action
        if a.kind in COMPUTE:
            source = None
            if a.kind is Kind.F and a.stage > 0:
                source, nbytes = (Kind.F, a.stage - 1, a.microbatch), output_bytes[a.stage - 1]
            elif a.kind in (Kind.B, Kind.I) and a.stage < last:
                up = (Kind.B, a.stage + 1, a.microbatch)
                source = up if up in ends else (Kind.I, a.stage + 1, a.microbatch)
                nbytes = output_bytes[a.stage]
            there, here = placement[source[1]] if source is not None else -1, placement[a.stage]
            apart = nodes is None or nodes[there] != nodes[here]
            if source in ends and there != here and apart != local:
                sent = ends[source]
                if busy_until.get(e.rank, -math.inf) < sent and e.start >= sent:
                    out.append((float(nbytes), e.start - sent))
        busy_until[e.rank] = max(busy_until.get(e.rank, -math.inf), e.end)
    return out


def reduce_transfers(
    steps: Sequence[Sequence[Timeline]], parameter_bytes: Sequence[float]
) -> list[tuple[float, float]]:
    """(bytes, delay) per message of each stage's gradient all-reduce, from ``steps``: per step, the timelines of
    the ``n`` replicas of one pipeline (same ranks, every replica on one clock). For stage ``s`` in a step the
    reduction starts at the latest SYNC start over the replicas; a replica whose STEP of ``s`` lasted longer
    than that STEP's least duration over every step and replica (the optimizer alone) waited for it, and its
    STEP's end less that least duration bounds when it ended; the tightest bound of the step is taken. A ring
    of ``2 (n - 1)`` messages of ``bytes / n`` (:func:`stagewise.planning.comm.ring_all_reduce`): the pair is
    ``(bytes / n, delay / (2 (n - 1)))``. Steps where no replica waited say nothing and are left out."""
    found: list[dict[int, tuple[list[Event], list[Event]]]] = []
    for replicas in steps:
        n = len(replicas)
        if n < 2:
            return []
        by: dict[int, tuple[list[Event], list[Event]]] = {}
        for timeline in replicas:
            for e in timeline.events:
                if e.action.kind in (Kind.SYNC, Kind.STEP):
                    by.setdefault(e.action.stage, ([], []))[e.action.kind is Kind.STEP].append(e)
        found.append(by)
    own: dict[int, float] = {}
    for by in found:
        for s, (_, opt) in by.items():
            for e in opt:
                own[s] = min(own.get(s, math.inf), e.duration)
    out = []
    for replicas, by in zip(steps, found):
        n = len(replicas)
        for s, (syncs, opt) in sorted(by.items()):
            if len(syncs) != n or len(opt) != n or s >= len(parameter_bytes) or parameter_bytes[s] <= 0:
                continue
            ready = max(e.start for e in syncs)
            waited = [e.end - own[s] for e in opt if e.end - own[s] > max(e.start, ready)]
            if waited:
                out.append((parameter_bytes[s] / n, (min(waited) - ready) / (2 * (n - 1))))
    return out


def fit_links(
    timelines: Sequence[Timeline],
    schedule: Schedule,
    output_bytes: Sequence[float],
    prior_bandwidth: float = math.inf,
    reductions: Sequence[tuple[float, float]] = (),
    nodes: Sequence[int] | None = None,
    local_prior: float | None = None,
    local_reductions: Sequence[tuple[float, float]] = (),
) -> tuple[LinkFit, LinkFit | None]:
    """The link between nodes and the one inside a node (``None`` without ``nodes`` or where no two of the plan's
    ranks share a node), each fitted through its own waited transfers (:func:`fit_link`; the
    all-reduce messages join the first), each keeping its own prior bandwidth where its transfers cannot identify
    one (``local_prior`` inside a node, ``prior_bandwidth`` where not given): a ping-pong inside a machine reads
    loopback, 350 times a 100 Mbit link's bandwidth (issue 49, 4 processes on the bandwidth link). Where the run
    waited for no transfer between nodes (one machine), the local fit stands for both: nothing better is known of
    the network. ``local_reductions``: all-reduce messages of replicas that share a machine, which join the fit
    inside one (and make one where no two pipeline ranks share a node)."""
    if nodes is not None and len(nodes) != schedule.num_ranks:
        raise ValueError(
            f"fit_links: nodes names {len(nodes)} pipeline ranks' nodes, the schedule has {schedule.num_ranks}"
        )
    if nodes is None:
        return fit_link(timelines, schedule, output_bytes, prior_bandwidth, [*reductions, *local_reductions]), None
    if len(set(nodes)) == len(nodes) and not local_reductions:
        return fit_link(timelines, schedule, output_bytes, prior_bandwidth, reductions), None
    between = fit_link(timelines, schedule, output_bytes, prior_bandwidth, reductions, nodes)
    inside_prior = prior_bandwidth if local_prior is None else local_prior
    inside = fit_link(timelines, schedule, output_bytes, inside_prior, local_reductions, nodes, local=True)
    if between.transfers == 0 and inside.transfers > 0:
        between = replace(inside, note=f"no waited transfer between nodes: the local link ({inside.note})")
    return between, inside
