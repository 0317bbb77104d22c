"""A rank's share of a core, probed with a short busy loop (issue 49 item 4: the straggler moved back).

A CPU quota (cgroup v1 ``cpu.cfs_quota_us``) caps the CPU seconds a process gets per period. A rank a re-cut left
with little work stays under its cap, so its steps show nothing of it, and the lift of the quota shows nothing
either. A loop that wants a whole core does meet the cap: its thread's CPU seconds over its wall seconds are the
share of a core the rank gets (0.25 under a quota of a quarter, whatever the period; below 1 too where other
processes take the core). While it holds a rank slow, :class:`~stagewise.runtime.Replanner` probes every rank
every few steps (:func:`probe_shares`, a collective: each loops at once, so that a machine loaded by others lowers
every share alike), and :func:`stagewise.planning.stragglers.lifted` says which held ranks are free again.
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


def cpu_share(seconds: float = PROBE_S, slowdown: float = 1.0) -> float:
    """This thread's CPU seconds over the wall seconds of a busy loop of ``seconds``; ``slowdown``: an emulated
    slowdown (``emulate_slowdown``), honoured as the interpreter does (sleeping ``slowdown - 1`` times the
    loop's time), so that an emulated straggler probes slow too."""
    wall0, cpu0 = time.perf_counter(), time.thread_time()
    x = 0
    while time.perf_counter() - wall0 < seconds:
        for i in range(CHUNK):
            x ^= i
    if slowdown != 1.0:
        time.sleep((slowdown - 1.0) * (time.perf_counter() - wall0))
    wall, cpu = time.perf_counter() - wall0, time.thread_time() - cpu0
    return min(1.0, cpu / wall) if wall > 0 else 1.0


def probe_shares(group: Any, slowdown: float = 1.0) -> list[float]:
    """Every rank's share of a core (:func:`cpu_share`, this rank's ``slowdown`` honoured), all probed at once, in
    group-rank order; a collective of the group."""
    return [float(x) for x in collectives.gather_json(cpu_share(slowdown=slowdown), group, what="the ranks' shares")]
