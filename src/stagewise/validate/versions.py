"""The version rules of asynchronous schedules, stated as reporting checks, on top of the schedule rules.

A schedule is asynchronous when ``meta["versions"]`` holds a
:class:`~stagewise.asynchronous.versions.VersionTable`. The rules (shape, table, policy and existence,
bounds) are listed once in :mod:`stagewise.validate`; each is stated here by the check that names every
problem of it (the stage, the rank and the action), checked in that order. :mod:`.versions_fast` decides
them first; these checks run when it refuses.
"""

from __future__ import annotations

from .._util import gc_paused
from ..asynchronous import VersionTable, live_versions, step_counts, version_bound, version_table
from ..ir import Kind, Schedule
from .schedules import ScheduleError
from .versions_fast import first_version_problem


def async_table(schedule: Schedule) -> VersionTable | None:
    """The schedule's version table, or None for a synchronous schedule."""
    table = schedule.meta.get("versions")
    if table is None:
        return None
    if not isinstance(table, VersionTable):
        raise ValueError(f"schedule {schedule.name!r}: meta['versions'] must be a VersionTable, got {type(table)}")
    return table


def validate_versions(schedule: Schedule) -> None:
    """Raise :class:`~stagewise.validate.ScheduleError` listing every broken version rule; None if all hold."""
    table = async_table(schedule)
    if table is None:
        return
    with gc_paused():
        problem = first_version_problem(schedule, table)  # decides, in a fraction of a second at 128 x 1024
    if problem is None:
        return
    # the reporting checks below name every broken rule; if they found none, the fast path's own words stand
    problems = _shape(schedule, table)
    if not problems:
        problems = _table_matches(schedule, table) or _rules(schedule, table) or _bounds(schedule, table)
    raise ScheduleError(schedule, problems or [problem])


def _shape(schedule: Schedule, table: VersionTable) -> list[str]:
    problems = []
    n_mb, m = table.minibatches, table.microbatches
    if schedule.virtual_stages != 1 or schedule.num_stages != schedule.num_ranks:
        problems.append(f"asynchronous schedules hold one stage per rank, got {schedule.num_stages} stages")
    if schedule.num_microbatches != n_mb * m:
        problems.append(
            f"the version table covers {n_mb} mini-batches x {m} micro-batches, "
            f"the schedule runs {schedule.num_microbatches} micro-batches"
        )
    if table.num_stages != schedule.num_stages:
        problems.append(f"the version table has {table.num_stages} stages, the schedule {schedule.num_stages}")
    for rank, acts in enumerate(schedule.ranks):
        steps: dict[int, int] = {}
        done: dict[int, int] = {}  # stage -> backwards done
        for idx, a in enumerate(acts):
            if a.kind in (Kind.I, Kind.W):
                problems.append(
                    f"rank {rank} action #{idx} {a}: asynchronous schedules run whole backwards (B), "
                    "not I/W: a split backward has no single weight version"
                )
            elif a.kind is Kind.B:
                done[a.stage] = done.get(a.stage, 0) + 1
            elif a.kind is Kind.STEP:
                k = steps.get(a.stage, 0)
                steps[a.stage] = k + 1
                if done.get(a.stage, 0) < (k + 1) * m:
                    problems.append(
                        f"rank {rank} action #{idx} {a}: STEP {k} of stage {a.stage} comes before the last backward "
                        f"of mini-batch {k} (micro-batches {k * m}..{k * m + m - 1})"
                    )
        for s in schedule.stages_of(rank):
            if steps.get(s, 0) != n_mb:
                problems.append(
                    f"rank {rank}: stage {s} has {steps.get(s, 0)} STEPs, expected one per mini-batch ({n_mb})"
                )
    return problems


def _table_matches(schedule: Schedule, table: VersionTable) -> list[str]:
    expected = version_table(schedule.ranks, schedule.num_stages, table.policy, table.minibatches, table.microbatches)
    problems = []
    for s in range(schedule.num_stages):
        for i in range(schedule.num_microbatches):
            for what, got, want in (
                ("F", table.forward[s][i], expected.forward[s][i]),
                ("B", table.backward[s][i], expected.backward[s][i]),
            ):
                if got != want:
                    problems.append(
                        f"rank {schedule.rank_of(s)}: {s}{what}{i} is tabled to use {got}, but policy "
                        f"{table.policy!r} on this action order gives {want}"
                    )
    return problems


def _rules(schedule: Schedule, table: VersionTable) -> list[str]:
    problems = []
    n, m = schedule.num_stages, table.microbatches
    c_f, c_b = step_counts(schedule.ranks, n, schedule.num_microbatches)
    for s in range(n):
        rank = schedule.rank_of(s)
        for i in range(schedule.num_microbatches):
            f, b = table.forward[s][i], table.backward[s][i]
            if table.policy != "none" and f != b:
                problems.append(
                    f"rank {rank}: {s}B{i} differentiates {b} but {s}F{i} ran on {f}; policy {table.policy!r} "
                    "needs the backward on the forward's (stashed) version"
                )
            if table.policy == "vertical" and f != table.forward[0][i]:
                problems.append(
                    f"rank {rank}: {s}F{i} uses {f}, but micro-batch {i} entered stage 0 at {table.forward[0][i]} "
                    "(vertical sync: every stage uses the version stage 0 tagged)"
                )
            if table.policy in ("2bw", "predict") and f != table.forward[s][(i // m) * m]:
                problems.append(
                    f"rank {rank}: {s}F{i} uses {f}, but mini-batch {i // m} started at stage {s} on "
                    f"{table.forward[s][(i // m) * m]}: all micro-batches of a mini-batch share one version"
                )
            for what, v, have in (("F", f, c_f[s][i]), ("B", b, c_b[s][i])):
                if v.base > have:
                    problems.append(
                        f"rank {rank}: {s}{what}{i} needs {v}, but stage {s} has made only versions 0..{have} there"
                    )
                if v.ahead and what == "F" and i == (i // m) * m and v.base != have:
                    problems.append(
                        f"rank {rank}: {s}F{i} predicts from W^({v.base}), but the current weights there are "
                        f"W^({have}): a prediction is made from the current weights"
                    )
    return problems


def _bounds(schedule: Schedule, table: VersionTable) -> list[str]:
    problems = []
    counts = live_versions(schedule.ranks, table)
    for rank, row in enumerate(counts):
        if not row:
            continue
        peak = max(row)
        s = schedule.stages_of(rank)[0]
        bound = version_bound(table.policy, schedule.num_ranks, table.microbatches, s)
        if peak > bound:
            idx = row.index(peak)
            problems.append(
                f"rank {rank} action #{idx} {schedule.ranks[rank][idx]}: stage {s} keeps {peak} weight versions, "
                f"more than the {bound} policy {table.policy!r} allows"
            )
    return problems
