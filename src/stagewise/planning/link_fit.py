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
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from ..ir import Kind, Schedule, Timeline

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
) -> LinkFit:
    """The link through the delays of the transfers a rank waited for (module docstring); ``prior_bandwidth``
    (bytes/s) kept where the delays cannot identify one."""
    if not prior_bandwidth > 0:
        raise ValueError(f"fit_link: prior_bandwidth must be > 0 bytes/s, got {prior_bandwidth!r}")
    pairs = [p for timeline in timelines for p in waited_transfers(timeline, schedule, output_bytes)]
    sizes = sorted({b for b, _ in pairs})
    if not pairs:
        return LinkFit(0.0, prior_bandwidth, False, 0, 0, f"no waited transfer: {_kept(prior_bandwidth)}")
    slope, intercept = _line(pairs)
    if slope is not None:
        return LinkFit(
            max(0.0, intercept), 1.0 / slope, True, len(pairs), len(sizes),
            f"fitted through {len(pairs)} waited transfers of {len(sizes)} sizes ({sizes[0]:.0f}-{sizes[-1]:.0f} B)",
        )  # fmt: skip
    latency = max(0.0, statistics.median(d - b / prior_bandwidth for b, d in pairs))
    why = (
        f"one size ({sizes[0]:.0f} B)"
        if len(sizes) == 1
        else f"sizes {sizes[0]:.0f}-{sizes[-1]:.0f} B (slope in the noise)"
    )
    note = f"{len(pairs)} waited transfers of {why}: bandwidth not identified, {_kept(prior_bandwidth)}"
    return LinkFit(latency, prior_bandwidth, False, len(pairs), len(sizes), note)


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
    timeline: Timeline, schedule: Schedule, output_bytes: Sequence[float]
) -> list[tuple[float, float]]:
    """(bytes, delay) for each compute action whose input came from another rank while its rank was idle."""
    placement = schedule.placement
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
            if source in ends and placement[source[1]] != placement[a.stage]:
                sent = ends[source]
                if busy_until.get(e.rank, -math.inf) < sent and e.start >= sent:
                    out.append((float(nbytes), e.start - sent))
        busy_until[e.rank] = max(busy_until.get(e.rank, -math.inf), e.end)
    return out
