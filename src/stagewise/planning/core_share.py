"""The cores a node's processes share, from each one's CPU affinity (issue 49 item 2: ranks pinned a core each).

The cost model shares a node's ``c`` cores among the ``n`` ranks computing at once, each at ``min(1, c / n)``
(:func:`stagewise.simulation.shared_makespan`; the calibration's de-sharing,
:func:`stagewise.planning.recalibrate.deshared`; the per-action CPU outside compute,
:func:`stagewise.planning.action_cost.action_overhead`). The runtime took ``c`` from its own process's
affinity: right for free ranks (each may run on every core), wrong for pinned ones (``stagewise run
--pin-cores``): each rank sees one core, so two ranks on two cores were modelled as two ranks taking turns on
one. Their overlapping compute was de-shared to half its length, each action's CPU outside compute priced at
half while the other rank computed, and every plan replayed on one core, where a bubble costs nothing and every
action's overhead adds up: the quiet pinned 2-process runs ranked the plans backwards (Kendall tau -0.49,
then -0.66; docs/benchmarks/calibration.md, ``calib5``).

From every rank's affinity on the node: its cores are the CPUs any of its processes may run on (the union);
the ranks are pinned when no two may run on one CPU. Pinned, ``n`` ranks computing never outnumber the union's
cores (``n`` disjoint non-empty sets), so the sharing model gives each its full speed: no rank waits for
another's core, and a rank's CPU outside its compute events (the interpreter, posting messages, its transport
threads) runs on its own core, in series with its own compute, as
:func:`~stagewise.planning.action_cost.with_overhead` adds it to the rank's actions. Sets that overlap without
being equal (ranks held two to a core by hand) are not described by one pool: they are priced as free ranks on
the union, faster than they run.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = ["node_cores", "pinned", "shared_seconds"]


def _sets(affinity: Sequence[Iterable[int]]) -> list[frozenset[int]]:
    sets = [frozenset(int(c) for c in cpus) for cpus in affinity]
    if not sets or not all(sets):
        raise ValueError(f"core share: one non-empty set of CPUs per rank on the node, got {list(map(sorted, sets))}")
    return sets


def node_cores(affinity: Sequence[Iterable[int]]) -> float:
    """The cores the node's ranks share (module docstring): the CPUs any of them may run on, from each rank's
    affinity (``os.sched_getaffinity``), e.g. ``[[0], [1]]`` pinned or ``[[0, 1], [0, 1]]`` free: 2 both."""
    return float(len(frozenset().union(*_sets(affinity))))


def pinned(affinity: Sequence[Iterable[int]]) -> bool:
    """Whether no two of the node's ranks may run on one CPU (each has cores of its own): ``[[0], [1]]`` yes,
    ``[[0, 1], [0, 1]]`` no; one rank alone: yes (no other rank shares its CPUs)."""
    sets = _sets(affinity)
    return sum(len(s) for s in sets) == len(frozenset().union(*sets))


def shared_seconds(spans: Sequence[tuple[float, float]], cores: float) -> list[float]:
    """Each ``(start, end)`` span's seconds on a core of its own when every span open at ``t`` shares ``cores``:
    the integral over the span of ``min(1, cores / n(t))``. A sweep over the spans' ends and a running integral,
    O(n log n): a live run pays it three times a step (on 32 actions of a real step, 0.03 ms where the slice by
    slice form took 0.14, 2026-12-04; four times that on a rank held to a quarter of a core)."""
    edges = sorted({t for span in spans for t in span})
    at = {t: k for k, t in enumerate(edges)}
    opened = [0] * (len(edges) + 1)  # +1 where a span starts, -1 where it ends: a running sum is n per slice
    for start, end in spans:
        if end > start:
            opened[at[start]] += 1
            opened[at[end]] -= 1
    integral, n = [0.0], 0  # integral[k]: the own-core seconds of one span open from edges[0] to edges[k]
    for k in range(len(edges) - 1):
        n += opened[k]
        rate = min(1.0, cores / n) if n else 1.0
        integral.append(integral[-1] + (edges[k + 1] - edges[k]) * rate)
    return [integral[at[end]] - integral[at[start]] if end > start else 0.0 for start, end in spans]
