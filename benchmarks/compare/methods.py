"""The comparison's rows: one :class:`Method` per pipeline method, and where other modules add theirs.

Another module adds rows by defining ``COMPARE_METHODS: list[Method]`` and
being named in :data:`EXTRA_METHOD_MODULES` (or on the command line,
``--extra-methods MODULE``, any importable module name). A spec with
``run=None`` is trained by :func:`.train.train_default` on
``method.build(p, m, window)``; a spec with ``run`` set (e.g. HetPipe's
virtual workers, :mod:`.hetpipe`) is trained by ``run(method, ctx, seed)``,
called on every rank at once (a collective), which must return the record
described in :func:`.train.train_default`. ``build`` is also what the
simulated columns simulate at p = 4 unless ``simulate`` is given (same return
shape as :func:`.costs.simulated`).
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import stagewise as sw
from stagewise.schedules import async_schedule

from .workloads import Workload


@dataclass
class RunContext:
    """What a method's trainer gets besides its seed: the workload, the options, this rank, the profiled costs."""

    workload: Workload
    args: argparse.Namespace
    rank: int
    world_size: int
    profiled: dict[str, Any]
    keep_timeline: bool  # gather a timeline of the last step/window (first seed only)
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Method:
    """One row: a name, its family ("sync" or "async"), how to build its schedule for p ranks, m micro-batches
    and a window of n mini-batches, and optionally its own trainer and simulation (see the module docstring)."""

    name: str
    family: str
    build: Callable[[int, int, int], sw.Schedule]
    run: Callable[[Method, RunContext, int], dict[str, Any]] | None = None
    simulate: Callable[[Method, RunContext], dict[str, Any]] | None = None
    reference: bool = True  # a "sync" row that trains as one process does: the verdicts' reference


def _sync(name: str, virtual: int | None = None) -> Callable[[int, int, int], sw.Schedule]:
    return lambda p, m, n: sw.build_schedule(name, p, m, virtual)


def _async(name: str, **options: bool) -> Callable[[int, int, int], sw.Schedule]:
    return lambda p, m, n: async_schedule(name, p, n, m, **options)


METHODS: list[Method] = [
    Method("gpipe", "sync", _sync("gpipe")),
    Method("1f1b", "sync", _sync("1f1b")),
    Method("zb-h1", "sync", _sync("zb-h1")),
    Method("interleaved-1f1b", "sync", _sync("interleaved-1f1b", 2)),
    Method("pipedream (stashing)", "async", _async("pipedream")),
    Method("pipedream (stashing + vertical sync)", "async", _async("pipedream", vertical_sync=True)),
    Method("pipedream (no stashing)", "async", _async("pipedream", stashing=False)),
    Method("pipedream-2bw", "async", _async("pipedream-2bw")),
    Method("xpipe", "async", _async("xpipe")),
]

#: modules whose ``COMPARE_METHODS`` rows are appended to METHODS
EXTRA_METHOD_MODULES: tuple[str, ...] = ("benchmarks.compare.hetpipe",)


def all_methods(extra: list[str] | None = None) -> list[Method]:
    """METHODS, then the rows of every module in EXTRA_METHOD_MODULES and ``extra``, in that order."""
    out = list(METHODS)
    for name in (*EXTRA_METHOD_MODULES, *(extra or [])):
        rows = getattr(importlib.import_module(name), "COMPARE_METHODS", None)
        if not isinstance(rows, list) or not all(isinstance(r, Method) for r in rows):
            raise ValueError(f"method module {name!r} must define COMPARE_METHODS: list[Method]")
        out += rows
    names = [m.name for m in out]
    if len(set(names)) != len(names):
        raise ValueError(f"method names must be unique, got {names}")
    return out
