"""The version validator's fast path: every rule of :mod:`stagewise.validate.versions`, decided row by row.

Why: at 128 ranks x 1024 micro-batches the rules are ~260 k table entries; the
reporting checks look at each with several comparisons and f-strings. Here the
table's rows are compared whole (tuple equality and ``map`` run in C) and only
the order is scanned in Python, once. It answers "valid or not"; when not,
:func:`stagewise.validate.versions.validate_versions` runs the reporting checks,
which name every broken rule. Each function here decides the rule of the reporting check
of the same name; tests/core/test_validator_rules.py compares each pair on edits that break
that rule, tests/core/test_versions_fast.py the whole verdicts.
"""

from __future__ import annotations

from itertools import chain, repeat
from operator import attrgetter, gt, ne

import numpy as np

from ..asynchronous import (
    VersionTable,
    live_version_counts,
    live_versions,
    running_counts,
    step_counts,
    version_bound,
    version_rows,
    version_table,
)
from ..asynchronous.versions import _in_range
from ..ir import STEP as _CSTEP
from ..ir import ActionRows, Columns, Kind, Schedule, columns
from ..ir import B as _CB
from ..ir import I as _CI
from ..ir import W as _CW

_B, _I, _W, _STEP = Kind.B, Kind.I, Kind.W, Kind.STEP
_base, _ahead = attrgetter("base"), attrgetter("ahead")


def first_version_problem(schedule: Schedule, table: VersionTable) -> str | None:
    """A short description of one broken rule, or None when every rule holds."""
    return _shape(schedule, table) or _table(schedule, table) or _rules(schedule, table) or _bounds(schedule, table)


def _shape(schedule: Schedule, table: VersionTable) -> str | None:
    n_mb, m = table.minibatches, table.microbatches
    if schedule.virtual_stages != 1 or schedule.num_stages != schedule.num_ranks:
        return "asynchronous schedules hold one stage per rank"
    if schedule.num_microbatches != n_mb * m or table.num_stages != schedule.num_stages:
        return "the version table's size differs from the schedule's"
    if isinstance(schedule.ranks, ActionRows):
        return _shape_columns(schedule, schedule.ranks.columns, n_mb, m)
    for rank, acts in enumerate(schedule.ranks):
        kinds = {a[1] for a in acts}
        if _I in kinds or _W in kinds:
            return f"rank {rank}: a split backward (I/W) in an asynchronous schedule"
        done: dict[int, int] = {}
        steps: dict[int, int] = {}
        for s, k, _ in acts:
            if k is _B:
                done[s] = done.get(s, 0) + 1
            elif k is _STEP:
                c = steps[s] = steps.get(s, 0) + 1
                if done.get(s, 0) < c * m:
                    return f"rank {rank}: STEP {c - 1} of stage {s} before the last backward of its mini-batch"
        if any(steps.get(s, 0) != n_mb for s in schedule.stages_of(rank)):
            return f"rank {rank}: a stage without one STEP per mini-batch"
    return None


def _shape_columns(schedule: Schedule, cols: Columns, n_mb: int, m: int) -> str | None:
    """The per-rank checks of :func:`_shape` on whole arrays; the first rank that fails names its first problem."""
    kind, stage, p, n = cols.kind, cols.stage, schedule.num_ranks, schedule.num_stages
    rank = cols.rank
    split = (kind == _CI) | (kind == _CW)
    is_step = kind == _CSTEP
    at_step = np.flatnonzero(is_step)
    # at each STEP of a stage: its backwards so far on this rank, and which STEP of the stage it is (1-based)
    done = running_counts(cols, n, kind == _CB)[at_step]
    c = running_counts(cols, n, is_step)[at_step] + 1
    early = at_step[done < c * m]
    steps = np.zeros((p, n), np.int64)
    np.add.at(steps, (rank[at_step], stage[at_step]), 1)
    placed = np.zeros((p, n), bool)
    placed[np.asarray(schedule.placement, np.int64), np.arange(n)] = True
    short = ((steps != n_mb) & placed).any(axis=1)
    bad_split = np.bincount(rank[split], minlength=p) > 0
    bad_early = np.bincount(rank[early], minlength=p) > 0
    failing = np.flatnonzero(bad_split | bad_early | short)
    if not failing.size:
        return None
    r = int(failing[0])
    if bad_split[r]:
        return f"rank {r}: a split backward (I/W) in an asynchronous schedule"
    if bad_early[r]:
        first = int(early[rank[early] == r][0])
        k = int(np.searchsorted(at_step, first))
        return f"rank {r}: STEP {int(c[k]) - 1} of stage {int(stage[first])} before the last backward of its mini-batch"
    return f"rank {r}: a stage without one STEP per mini-batch"


def _table(schedule: Schedule, table: VersionTable) -> str | None:
    args = (schedule.ranks, schedule.num_stages, table.policy, table.minibatches, table.microbatches)
    expected = None
    if _in_range(schedule.ranks, schedule.num_stages, schedule.num_microbatches):
        try:
            expected = version_rows(*args)
        except TypeError:  # an F or B without a micro-batch: the reference computation skips it
            pass
    if expected is None:
        full = version_table(*args)
        expected = list(full.forward), list(full.backward)
    if table.forward != tuple(expected[0]) or table.backward != tuple(expected[1]):
        return f"the table is not the one policy {table.policy!r} gives for this action order"
    return None


def _rules(schedule: Schedule, table: VersionTable) -> str | None:
    n, m, total = schedule.num_stages, table.microbatches, schedule.num_microbatches
    fwd, bwd = table.forward, table.backward
    c_f, c_b = step_counts(schedule.ranks, n, total)
    shared = table.policy in ("2bw", "predict")
    for s in range(n):
        f, b = fwd[s], bwd[s]
        if table.policy != "none" and f != b:
            return f"stage {s}: a backward differentiates another version than its forward"
        if table.policy == "vertical" and f != fwd[0]:
            return f"stage {s}: a forward uses another version than stage 0 tagged"
        starts = f[::m]  # each mini-batch's first micro-batch
        if shared and f != tuple(chain.from_iterable(repeat(v, m) for v in starts)):
            return f"stage {s}: the micro-batches of a mini-batch use different versions"
        if any(map(gt, map(_base, f), c_f[s])) or any(map(gt, map(_base, b), c_b[s])):
            return f"stage {s}: a version used before the stage has made it"
        if any(map(ne, (v.base for v in starts if v.ahead), (c for v, c in zip(starts, c_f[s][::m]) if v.ahead))):
            return f"stage {s}: a prediction not made from the current weights"
    return None


def _bounds(schedule: Schedule, table: VersionTable) -> str | None:
    cols = columns(schedule)
    counts = None if cols is None else live_version_counts(cols, table)
    peaks = (
        [max(row, default=0) for row in live_versions(schedule.ranks, table)]
        if counts is None
        else [int(row.max()) if row.size else 0 for row in counts]
    )
    for rank, peak in enumerate(peaks):
        if not peak:
            continue
        s = schedule.stages_of(rank)[0]
        if peak > version_bound(table.policy, schedule.num_ranks, table.microbatches, s):
            return f"rank {rank}: stage {s} keeps more weight versions than policy {table.policy!r} allows"
    return None
