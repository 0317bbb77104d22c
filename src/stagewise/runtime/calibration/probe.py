"""A rank's share of a core, probed with a short busy loop (issue 49 item 4: the straggler moved back).

A CPU quota (cgroup v1 ``cpu.cfs_quota_us``) caps the CPU seconds a process gets per period. A rank a re-cut left
with little work stays under its cap, so its steps show nothing of it, and the lift of the quota shows nothing
either. A loop that wants a whole core does meet the cap: the CPU time it gets over the wall time it runs is the
share of a core the rank gets. Read between the first and the last time the loop was held off its core, the
window holds whole periods of the quota, so the share is the quota's (a quarter reads 0.25): over the whole loop
it would also count what the period the loop began in had left (0.45-0.68 at a half over 30 ms, the 16:15 run).
Being absolute, it does not move when a peer is disturbed during the probe (the 2026-12-03 03:02 run: a peer
sharing its core for a moment read 0.7 of its usual rate, and a held rank read against it looked free). While it
holds a rank slow, :class:`~stagewise.runtime.Replanner` probes every rank every few steps (:func:`probe_shares`,
a collective: each loops at once), and :func:`stagewise.planning.stragglers.lifted` says which held ranks are
free again, against :func:`stagewise.planning.stragglers.reference` (a machine loaded by others lowers every
rank's share alike).

A cap a rank's own cgroup explains is watched more cheaply: :func:`quota_share` reads the quota (cgroup v1
``cpu.cfs_quota_us`` over ``cpu.cfs_period_us``, v2 ``cpu.max``, the least over the group and its ancestors), a
file read where the loop costs 30 ms of every rank (2026-12-04: the probes were 9 ms of a held rank's step at a
quarter of a core). Container runtimes read the same files to size their thread pools. It sees a quota and
nothing else (another process on the core, an emulated slowdown), so the Replanner reads it only to know when to
probe again a cap the loop found equal to the quota: when the quota moves (:mod:`.held`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..comm import collectives

#: the probe's wall seconds: three periods of a 10 ms quota, so that the loop is held off its core at least
#: twice and the window between holds whole periods
PROBE_S = 0.03
#: loop iterations between two looks at the clocks (about 0.1 ms of CPU)
CHUNK = 2000
#: a look at the clocks whose wall time exceeds its CPU time by more than this: the loop was held off its core
HELD_S = 0.0005


def core_share(seconds: float = PROBE_S, slowdown: float = 1.0) -> float:
    """The share of a core a busy loop of ``seconds`` gets (its thread's CPU time over wall time, between its
    first and last hold-off when it was held off twice or more, else over the whole loop): what a quota, or other
    processes on the core, leave this rank. ``slowdown``: an emulated slowdown (``emulate_slowdown``), honoured as
    the interpreter does (sleeping ``slowdown - 1`` times the loop's time), so that an emulated straggler reads
    ``1 / slowdown``."""
    wall0, cpu0 = time.perf_counter(), time.thread_time()
    looks = [(wall0, cpu0)]
    held: list[int] = []  # the looks that ended a hold-off
    x = 0
    while looks[-1][0] - wall0 < seconds:
        for i in range(CHUNK):
            x ^= i
        look = (time.perf_counter(), time.thread_time())
        if (look[0] - looks[-1][0]) - (look[1] - looks[-1][1]) > HELD_S:
            held.append(len(looks))
        looks.append(look)
    if slowdown != 1.0:
        time.sleep((slowdown - 1.0) * (looks[-1][0] - wall0))
        looks.append((time.perf_counter(), time.thread_time()))
    return window_share(looks, held)


def window_share(looks: list[tuple[float, float]], held: list[int]) -> float:
    """CPU over wall between the first and last of the ``held`` looks (each ends a hold-off) when there are two
    or more, else over all ``looks`` (``(wall, cpu)`` seconds, in order); in ``[0, 1]``."""
    (w0, c0), (w1, c1) = (looks[held[0]], looks[held[-1]]) if len(held) >= 2 else (looks[0], looks[-1])
    if w1 <= w0:
        return 1.0
    return min(max((c1 - c0) / (w1 - w0), 0.0), 1.0)


def probe_shares(group: Any, slowdown: float = 1.0, wait: collectives.Wait | None = None) -> list[float]:
    """Every rank's :func:`core_share` (this rank's ``slowdown`` honoured), all probed at once, in group-rank
    order; a collective of the group, waited through ``wait`` (the pipeline guard's: its deadline and board)."""
    shares = collectives.gather_json(core_share(slowdown=slowdown), group, wait, "the ranks' shares")
    return [float(x) for x in shares]


#: where the cgroup file systems are mounted
CGROUP_ROOT = Path("/sys/fs/cgroup")


def quota_share(cgroup: str | None = None, root: Path = CGROUP_ROOT) -> float | None:
    """This process's CPU quota as a share of one core (at most 1): the least of ``quota / period`` over its cpu
    cgroup and every ancestor, 1.0 where none sets a quota; None where no cgroup can be read (another OS, no cpu
    controller mounted). ``cgroup``: the text of ``/proc/self/cgroup`` (read when None)."""
    if cgroup is None:
        try:
            cgroup = Path("/proc/self/cgroup").read_text()
        except OSError:
            return None
    found: list[tuple[Path, str]] = []  # (the controller's mount, the group's path), v1 first
    for line in cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if "cpu" in controllers.split(","):
            mount = next((root / m for m in (controllers, "cpu", "cpu,cpuacct") if (root / m).is_dir()), None)
            if mount is not None:
                found.insert(0, (mount, path))
        elif controllers == "" and (root / "cgroup.controllers").exists():
            found.append((root, path))  # cgroup v2: one hierarchy
    if not found:
        return None
    mount, path = found[0]
    share, seen = 1.0, False
    group = mount / path.lstrip("/")
    while True:
        limit = _limit(group)
        if limit is not None:
            seen = True
            share = min(share, limit)
        if group == mount or mount not in group.parents:
            break
        group = group.parent
    return share if seen else None


def _limit(group: Path) -> float | None:
    """One group's quota as a share of a core (1.0 when it sets none, at most 1), None when it has no readable
    quota file."""
    try:
        if (group / "cpu.cfs_quota_us").exists():
            quota = int((group / "cpu.cfs_quota_us").read_text())
            period = int((group / "cpu.cfs_period_us").read_text())
            return 1.0 if quota < 0 or period <= 0 else min(1.0, quota / period)
        if (group / "cpu.max").exists():
            quota_text, period_text = (group / "cpu.max").read_text().split()[:2]
            return 1.0 if quota_text == "max" else min(1.0, int(quota_text) / int(period_text))
    except (OSError, ValueError):
        return None
    return None


def quota_shares(group: Any, wait: collectives.Wait | None = None) -> list[float | None]:
    """Every rank's :func:`quota_share`, in group-rank order; a collective of the group (a few bytes), waited
    through ``wait`` (the pipeline guard's: its deadline and board)."""
    return [None if x is None else float(x) for x in collectives.gather_json(quota_share(), group, wait, "the quotas")]


def pipeline_wait(pipe: Any) -> collectives.Wait | None:
    """The wait of ``pipe``'s guard as it is now (its deadline and error board; None without one): looked up at each
    probe, since a re-layout gives the pipeline a new transport and closes the old one's guard."""
    guard = getattr(getattr(pipe, "transport", None), "guard", None)
    return None if guard is None else guard.wait


def slowdown_of(pipe: Any) -> float:
    """This rank's emulated slowdown (``emulate_slowdown``; 1 without), which the probe honours: the options'
    factor for the pipeline rank, as the interpreter was given it."""
    options = getattr(pipe, "options", None)
    if options is None or not hasattr(options, "slowdown_of"):
        return 1.0
    return float(options.slowdown_of(pipe.rank, pipe.num_ranks))


def pipeline_probes(pipe: Any) -> tuple[Callable[[], list[float]], Callable[[], list[float | None]]]:
    """``pipe``'s probes of every rank: the loop's shares (this rank's emulated slowdown honoured) and the quotas,
    each a collective of the default group waited as ``pipe``'s steps are (:func:`pipeline_wait`)."""
    return (
        lambda: probe_shares(None, slowdown_of(pipe), pipeline_wait(pipe)),
        lambda: quota_shares(None, pipeline_wait(pipe)),
    )
