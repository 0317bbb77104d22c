"""The straightforward weight-version computations, kept as the reference the fast ones in
:mod:`stagewise.asynchronous.versions` are property-tested against (``tests/core/test_versions_fast.py``).

Action by action, with dicts keyed by ``Version`` and text forms: easy to read against the definitions in
:mod:`stagewise.asynchronous.versions`, and seconds-slow at 128 ranks x 1024 micro-batches.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..ir import Action, Kind
from .table import POLICIES, Version, VersionTable


def step_counts(
    ranks: Sequence[Sequence[Action]], num_stages: int, num_microbatches: int
) -> tuple[list[list[int]], list[list[int]]]:
    """(c_F, c_B): how many STEPs of stage s precede its F / B of micro-batch i in its rank's order (-1 if absent)."""
    c_f = [[-1] * num_microbatches for _ in range(num_stages)]
    c_b = [[-1] * num_microbatches for _ in range(num_stages)]
    for acts in ranks:
        steps: dict[int, int] = {}
        for a in acts:
            if a.kind is Kind.STEP:
                steps[a.stage] = steps.get(a.stage, 0) + 1
            elif a.kind is Kind.F and a.microbatch is not None:
                c_f[a.stage][a.microbatch] = steps.get(a.stage, 0)
            elif a.kind is Kind.B and a.microbatch is not None:
                c_b[a.stage][a.microbatch] = steps.get(a.stage, 0)
    return c_f, c_b


def version_table(
    ranks: Sequence[Sequence[Action]], num_stages: int, policy: str, minibatches: int, microbatches: int
) -> VersionTable:
    """The table of ``policy`` (see the module docstring) for the action lists ``ranks``."""
    if policy not in POLICIES:
        raise ValueError(f"unknown weight-version policy {policy!r}; expected one of {', '.join(POLICIES)}")
    n, m = num_stages, microbatches
    total = minibatches * m
    c_f, c_b = step_counts(ranks, n, total)
    fwd: list[list[Version]] = [[Version(0)] * total for _ in range(n)]
    bwd: list[list[Version]] = [[Version(0)] * total for _ in range(n)]
    first_f = _first_forward(ranks, n, minibatches, m)
    for s in range(n):
        for i in range(total):
            t = i // m
            if policy == "stash":
                fwd[s][i] = bwd[s][i] = Version(c_f[s][i])
            elif policy == "none":
                fwd[s][i], bwd[s][i] = Version(c_f[s][i]), Version(c_b[s][i])
            elif policy == "vertical":
                fwd[s][i] = bwd[s][i] = Version(c_f[0][i])
            elif policy == "2bw":
                fwd[s][i] = bwd[s][i] = Version(max(0, t - 1))
            else:  # predict: the bellwether's version, t - c updates ahead
                c = c_f[s][first_f[s][t]] if first_f[s][t] >= 0 else 0
                fwd[s][i] = bwd[s][i] = Version(c, max(0, t - c))
    release, keep = _lifetimes(ranks, n, fwd, bwd)
    return VersionTable(
        policy=policy,
        minibatches=minibatches,
        microbatches=m,
        forward=tuple(tuple(r) for r in fwd),
        backward=tuple(tuple(r) for r in bwd),
        release=tuple(release),
        keep_at_step=tuple(tuple(k) for k in keep),
    )


def _first_forward(ranks: Sequence[Sequence[Action]], n: int, minibatches: int, m: int) -> list[list[int]]:
    """first[s][t]: the micro-batch of mini-batch t that stage s forwards first (its bellwether), -1 if none."""
    first = [[-1] * minibatches for _ in range(n)]
    for acts in ranks:
        for a in acts:
            if a.kind is Kind.F and a.microbatch is not None:
                t = a.microbatch // m
                if 0 <= t < minibatches and first[a.stage][t] < 0:
                    first[a.stage][t] = a.microbatch
    return first


def _uses(a: Action, fwd: list[list[Version]], bwd: list[list[Version]]) -> Version | None:
    if a.microbatch is None or not 0 <= a.stage < len(fwd) or not 0 <= a.microbatch < len(fwd[a.stage]):
        return None
    if a.kind is Kind.F:
        return fwd[a.stage][a.microbatch]
    if a.kind is Kind.B:
        return bwd[a.stage][a.microbatch]
    return None


def _lifetimes(
    ranks: Sequence[Sequence[Action]], n: int, fwd: list[list[Version]], bwd: list[list[Version]]
) -> tuple[list[dict[str, tuple[Version, ...]]], list[list[bool]]]:
    """Per stage: after which action each version is used for the last time; whether W^(c) outlives its STEP."""
    last_use: list[dict[Version, str]] = [{} for _ in range(n)]
    used_after_step: list[set[int]] = [set() for _ in range(n)]
    steps_of: list[int] = [0] * n
    for acts in ranks:
        for a in acts:
            if a.kind is Kind.STEP and 0 <= a.stage < n:
                steps_of[a.stage] += 1
                continue
            v = _uses(a, fwd, bwd)
            if v is None:
                continue
            last_use[a.stage][v] = str(a)
    for acts in ranks:
        count: dict[int, int] = {}
        for a in acts:
            if a.kind is Kind.STEP and 0 <= a.stage < n:
                count[a.stage] = count.get(a.stage, 0) + 1
                continue
            v = _uses(a, fwd, bwd)
            if v is not None and v.ahead == 0 and v.base < count.get(a.stage, 0):
                used_after_step[a.stage].add(v.base)
    release: list[dict[str, tuple[Version, ...]]] = [{} for _ in range(n)]
    for s in range(n):
        grouped: dict[str, list[Version]] = {}
        for v, where in last_use[s].items():
            grouped.setdefault(where, []).append(v)
        release[s] = {k: tuple(sorted(vs)) for k, vs in grouped.items()}
    keep = [[c in used_after_step[s] for c in range(steps_of[s] + 1)] for s in range(n)]
    return release, keep


def live_versions(ranks: Sequence[Sequence[Action]], table: VersionTable) -> list[list[int]]:
    """counts[r][j]: distinct weight versions stage-holding rank r keeps while running its j-th action.

    Counted: the current weights; every older W^(c) still to be used (at or
    after action j); every prediction between its first and its last use.
    Actions that are not F, B or STEP count the versions alive around them.
    Each version is alive over one interval of the rank's actions, so a sweep
    counts them in time linear in the actions and versions.
    """
    n = table.num_stages
    fwd = [list(r) for r in table.forward]
    bwd = [list(r) for r in table.backward]
    out: list[list[int]] = []
    for acts in ranks:
        end = len(acts)
        steps: dict[int, list[int]] = {}
        first: dict[tuple[int, Version], int] = {}
        last: dict[tuple[int, Version], int] = {}
        for j, a in enumerate(acts):
            if a.kind is Kind.STEP:
                steps.setdefault(a.stage, []).append(j)
                continue
            v = _uses(a, fwd, bwd) if a.stage < n else None
            if v is not None:
                first.setdefault((a.stage, v), j)
                last[(a.stage, v)] = j
        intervals: dict[tuple[int, Version], tuple[int, int]] = {}
        for s in {a.stage for a in acts}:
            at = steps.get(s, [])
            for c in range(len(at) + 1):  # W^(c) is current from the STEP that makes it to the one replacing it
                intervals[(s, Version(c))] = (0 if c == 0 else at[c - 1] + 1, at[c] if c < len(at) else end - 1)
        for key, lo in first.items():
            hi = last[key]
            if key in intervals:  # an older version is kept until its last use
                lo, hi = min(lo, intervals[key][0]), max(hi, intervals[key][1])
            intervals[key] = (lo, hi)
        diff = [0] * (end + 1)
        for lo, hi in intervals.values():
            if lo <= hi:
                diff[lo] += 1
                diff[hi + 1] -= 1
        counts, live = [], 0
        for j in range(end):
            live += diff[j]
            counts.append(live)
        out.append(counts)
    return out
