"""A rank's share of a core, probed with a short busy loop (issue 49 item 4: the straggler moved back).

A CPU quota (cgroup v1 ``cpu.cfs_quota_us``) caps the CPU seconds a process gets per period. A rank a re-cut left
with little work stays under its cap, so its steps show nothing of it, and the lift of the quota shows nothing
either. A loop that wants a whole core does meet the cap: the iterations it does per wall second, against the
other ranks' at the same moment, are the share of a core the rank gets (a quarter of theirs under a quota of a
quarter; a slower core shows too, and other processes loading every core lower every rank's alike). While it
holds a rank slow, :class:`~stagewise.runtime.Replanner` probes every rank every few steps (:func:`probe_shares`,
a collective: each loops at once), and :func:`stagewise.planning.stragglers.lifted` says which held ranks are
free again.
"""

from __future__ import annotations

import time
from typing import Any

from ..comm import collectives

#: the probe's wall seconds: at least three periods of a 10 ms quota, so that the CPU a period had left when the
#: loop began (one period's share at most) moves the figure by under a third at a quarter of a core (the
#: probe only tells a held rank, 0.5 or below, from a free one, above 0.9)
PROBE_S = 0.03
#: loop iterations between two looks at the clock
CHUNK = 2000


def loop_rate(seconds: float = PROBE_S, slowdown: float = 1.0) -> float:
    """Iterations per wall second of a busy loop of ``seconds``: what a quota (or a slower core, or other
    processes on it) leaves this rank; ``slowdown``: an emulated slowdown (``emulate_slowdown``), honoured as the
    interpreter does (sleeping ``slowdown - 1`` times the loop's time), so that an emulated straggler probes
    slow too."""
    start = time.perf_counter()
    done, x = 0, 0
    while time.perf_counter() - start < seconds:
        for i in range(CHUNK):
            x ^= i
        done += CHUNK
    if slowdown != 1.0:
        time.sleep((slowdown - 1.0) * (time.perf_counter() - start))
    return done / (time.perf_counter() - start)


def probe_shares(group: Any, slowdown: float = 1.0) -> list[float]:
    """Every rank's :func:`loop_rate` (this rank's ``slowdown`` honoured), all probed at once, in group-rank
    order; a collective of the group. Only the ratios mean anything: a loaded machine lowers every rank's."""
    return [float(x) for x in collectives.gather_json(loop_rate(slowdown=slowdown), group, what="the ranks' rates")]
