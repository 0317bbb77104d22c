"""Weight versions of asynchronous schedules: which weights every forward and backward uses, as data.

Vocabulary (one stage per rank, stage s on rank s): a window of N mini-batches
of m micro-batches each; the global micro-batch index is i = t*m + k
(mini-batch t, micro-batch k of it). Each stage applies its optimizer at its
own STEP actions, one per mini-batch, so stage s's weights after c STEPs are
its *version* c: W_s^(0) is what the window starts with, and

    W_s^(c+1) = opt_s(W_s^(c), G_s(c))                                     (update)

where G_s(c) is mini-batch c's coalesced gradient at stage s: the sum over its
micro-batches k of the gradient of w_k * loss_k (w_k the micro-batch's share of
the mini-batch), each computed at the version the policy says. The k-th STEP
of a stage applies mini-batch k's gradient to the *current* weights.

Let c_F(s, i) and c_B(s, i) be the number of STEPs stage s has executed before
its F, respectively B, of micro-batch i (read off the action order). A
*version key* (c, d) names W_s^(c) when d = 0, and an XPipe prediction made
from it d updates ahead when d > 0. The policies:

* ``stash`` (PipeDream, weight stashing): F and B of (s, i) use (c_F(s, i), 0).
* ``none`` (no stashing, the incorrect baseline): F uses (c_F(s, i), 0); B
  uses (c_B(s, i), 0), the weights current when the backward runs: it
  recomputes the stage's forward from the saved stage input x with those
  weights and backpropagates through that, so both the weight gradient and
  the input gradient handed back are d f_s(x; W^(c_B)).
* ``vertical`` (PipeDream vertical sync, with stashing): F and B of (s, i)
  use (c_F(0, i), 0), the version stage 0 used; the index travels with the
  activation. It must exist at stage s when F runs: c_F(0, i) <= c_F(s, i).
* ``2bw`` (PipeDream-2BW): every micro-batch of mini-batch t uses
  (max(0, t - 1), 0) for F and B, so W(t+1) = W(t) - lr * grad f(W(t-1)) under
  SGD. Version t - 1 must exist at t's first forward: m >= p - 1.
* ``predict`` (XPipe): at mini-batch t's first forward at stage s (its
  *bellwether*), with c = c_F(s, bellwether) and d = t - c (the updates that
  land at s between that forward and t's own STEP t), every micro-batch of t
  uses (c, d): Ŵ = W^(c) - lr * d * u(c), u the optimizer's update direction
  after version c (:mod:`stagewise.runtime.asynchronous.predict`).

Liveness: W^(c) exists from the STEP that makes it (the window start for c = 0)
until it is neither current nor used again; a prediction from its first use
to its last. :func:`live_versions` counts them per stage at every action.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate, chain, repeat
from operator import itemgetter

from .._util import gc_paused
from ..ir import Action, ActionRows, Kind, in_range
from . import arrays as _columns
from . import reference as _reference
from .table import POLICIES, Version, VersionTable

_F, _B, _STEP = Kind.F, Kind.B, Kind.STEP
_stage_of, _mb_of = itemgetter(0), itemgetter(2)
_TEXT = {k: k.value for k in Kind}


def step_counts(
    ranks: Sequence[Sequence[Action]], num_stages: int, num_microbatches: int
) -> tuple[list[list[int]], list[list[int]]]:
    """(c_F, c_B): how many STEPs of stage s precede its F / B of micro-batch i in its rank's order (-1 if absent)."""
    if not _in_range(ranks, num_stages, num_microbatches):
        return _reference.step_counts(ranks, num_stages, num_microbatches)
    try:
        return _step_counts_any(ranks, num_stages, num_microbatches)
    except TypeError:  # an F or B without a micro-batch
        return _reference.step_counts(ranks, num_stages, num_microbatches)


def _step_counts_any(
    ranks: Sequence[Sequence[Action]], n: int, num_microbatches: int
) -> tuple[list[list[int]], list[list[int]]]:
    """:func:`_step_counts`, on the columns when ``ranks`` is columns (in range: the caller checked)."""
    if isinstance(ranks, ActionRows):
        counts = _columns.step_counts_columns(ranks.columns, n, num_microbatches)
        if counts is not None:
            return counts[0].tolist(), counts[1].tolist()
    return _step_counts(ranks, n, num_microbatches)


def _step_counts(
    ranks: Sequence[Sequence[Action]], n: int, num_microbatches: int
) -> tuple[list[list[int]], list[list[int]]]:
    c_f = [[-1] * num_microbatches for _ in range(n)]
    c_b = [[-1] * num_microbatches for _ in range(n)]
    for acts in ranks:
        steps = dict.fromkeys(map(_stage_of, acts), 0)
        for s, k, i in acts:
            if k is _F:
                c_f[s][i] = steps[s]  # type: ignore[index]  # None: TypeError, the caller falls back
            elif k is _B:
                c_b[s][i] = steps[s]  # type: ignore[index]  # None: TypeError, the caller falls back
            elif k is _STEP:
                steps[s] += 1
    return c_f, c_b


def version_table(
    ranks: Sequence[Sequence[Action]], num_stages: int, policy: str, minibatches: int, microbatches: int
) -> VersionTable:
    """The table of ``policy`` (see the module docstring) for the action lists ``ranks``.

    Rows are built from interned ``Version`` objects (rows that are equal by the policy's rule are one
    object), so the table of 128 ranks x 1024 micro-batches takes a fraction of a second.
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown weight-version policy {policy!r}; expected one of {', '.join(POLICIES)}")
    n, m = num_stages, microbatches
    if not _in_range(ranks, n, minibatches * m):
        return _reference.version_table(ranks, n, policy, minibatches, m)
    try:
        fwd, bwd = version_rows(ranks, n, policy, minibatches, m)
    except TypeError:  # an F or B without a micro-batch
        return _reference.version_table(ranks, n, policy, minibatches, m)
    if isinstance(ranks, ActionRows):
        release, keep = _columns.lifetimes_columns(ranks.columns, n, tuple(fwd), tuple(bwd))
    else:
        release, keep = _lifetimes(ranks, n, fwd, bwd)
    return VersionTable(
        policy=policy,
        minibatches=minibatches,
        microbatches=m,
        forward=tuple(fwd),
        backward=tuple(bwd),
        release=tuple(release),
        keep_at_step=tuple(tuple(k) for k in keep),
    )


def version_rows(
    ranks: Sequence[Sequence[Action]], n: int, policy: str, minibatches: int, m: int
) -> tuple[list[tuple[Version, ...]], list[tuple[Version, ...]]]:
    """The forward and backward rows of :func:`version_table`, without the lifetimes (for the validator)."""
    c_f, c_b = _step_counts_any(ranks, n, minibatches * m)
    cache: dict[tuple[int, int], Version] = {}
    fwd: list[tuple[Version, ...]]
    bwd: list[tuple[Version, ...]]
    if policy == "stash":
        fwd = bwd = [_interned(row, cache) for row in c_f]
    elif policy == "none":
        fwd, bwd = [_interned(row, cache) for row in c_f], [_interned(row, cache) for row in c_b]
    elif policy == "vertical":
        row = _interned(c_f[0], cache) if n else ()
        fwd = bwd = [row] * n
    elif policy == "2bw":
        row = _per_minibatch([_version(max(0, t - 1), 0, cache) for t in range(minibatches)], m)
        fwd = bwd = [row] * n
    else:  # predict: the bellwether's version, t - c updates ahead
        first_f = (
            _columns.first_forward_columns(ranks.columns, n, minibatches, m).tolist()
            if isinstance(ranks, ActionRows)
            else _first_forward(ranks, n, minibatches, m)
        )
        fwd = []
        for s in range(n):
            bases = [c_f[s][first] if first >= 0 else 0 for first in first_f[s]]
            fwd.append(_per_minibatch([_version(c, max(0, t - c), cache) for t, c in enumerate(bases)], m))
        bwd = fwd
    return fwd, bwd


def _in_range(ranks: Sequence[Sequence[Action]], n: int, total: int) -> bool:
    """Every stage in 0..n-1 and every micro-batch None or in 0..total-1 (checked in C): the fast paths index by them.

    Anything else (a hand-edited schedule the validator has not seen yet) goes to the reference implementations,
    which skip what is out of range; so does an F or B without a micro-batch (the fast paths raise TypeError).
    """
    if isinstance(ranks, ActionRows):
        return in_range(ranks.columns, n, total)
    for acts in ranks:
        stages = set(map(_stage_of, acts))
        if stages and (min(stages) < 0 or max(stages) >= n):
            return False
        mbs = set(map(_mb_of, acts))
        mbs.discard(None)
        if mbs and (min(mbs) < 0 or max(mbs) >= total):
            return False
    return True


def _version(base: int, ahead: int, cache: dict[tuple[int, int], Version]) -> Version:
    v = cache.get((base, ahead))
    if v is None:
        v = cache[(base, ahead)] = Version(base, ahead)
    return v


def _interned(row: list[int], cache: dict[tuple[int, int], Version]) -> tuple[Version, ...]:
    """``tuple(Version(c) for c in row)``, each distinct version one object."""
    by_base = {c: _version(c, 0, cache) for c in set(row)}
    return tuple(map(by_base.__getitem__, row))


def _per_minibatch(versions: list[Version], m: int) -> tuple[Version, ...]:
    """One version per mini-batch, repeated for its m micro-batches."""
    return tuple(chain.from_iterable(repeat(v, m) for v in versions))


def _first_forward(ranks: Sequence[Sequence[Action]], n: int, minibatches: int, m: int) -> list[list[int]]:
    """first[s][t]: the micro-batch of mini-batch t that stage s forwards first (its bellwether), -1 if none."""
    first = [[-1] * minibatches for _ in range(n)]
    for acts in ranks:
        for s, k, i in acts:
            if k is _F:
                t = i // m  # type: ignore[operator]  # None: TypeError, the caller falls back
                if 0 <= t < minibatches and first[s][t] < 0:
                    first[s][t] = i  # type: ignore[assignment]
    return first


def _lifetimes(
    ranks: Sequence[Sequence[Action]], n: int, fwd: Sequence[Sequence[Version]], bwd: Sequence[Sequence[Version]]
) -> tuple[list[dict[str, tuple[Version, ...]]], list[list[bool]]]:
    """Per stage: after which action each version is used for the last time; whether W^(c) outlives its STEP.

    One scan of every rank; the text form is made only for the actions that end up last.
    """
    last_use: list[dict[Version, tuple[int, int]]] = [{} for _ in range(n)]
    used_after_step: list[set[int]] = [set() for _ in range(n)]
    steps_of = [0] * n
    for rank, acts in enumerate(ranks):
        count = [0] * n  # STEPs of each stage so far on this rank
        for j, (s, k, i) in enumerate(acts):
            if k is _F:
                v = fwd[s][i]  # type: ignore[index]  # None: TypeError, the caller falls back
            elif k is _B:
                v = bwd[s][i]  # type: ignore[index]  # None: TypeError, the caller falls back
            elif k is _STEP:
                steps_of[s] += 1
                count[s] += 1
                continue
            else:
                continue
            last_use[s][v] = (rank, j)
            if not v[1] and v[0] < count[s]:
                used_after_step[s].add(v[0])
    release: list[dict[str, tuple[Version, ...]]] = []
    for s in range(n):
        grouped: dict[str, list[Version]] = {}
        for v, (rank, j) in last_use[s].items():
            a = ranks[rank][j]
            grouped.setdefault(f"{a[0]}{_TEXT[a[1]]}{a[2]}", []).append(v)
        release.append({k: tuple(sorted(vs)) for k, vs in grouped.items()})
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
    if not _in_range(ranks, n, table.minibatches * table.microbatches) or any(
        len(row) != table.minibatches * table.microbatches for row in (*table.forward, *table.backward)
    ):
        return _reference.live_versions(ranks, table)
    if isinstance(ranks, ActionRows):
        counts = _columns.live_version_counts(ranks.columns, table)
        if counts is not None:
            return [row.tolist() for row in counts]
    try:
        with gc_paused():  # ~1 tuple per action, all acyclic
            return _live_versions(ranks, table.forward, table.backward)
    except TypeError:  # an F or B without a micro-batch
        return _reference.live_versions(ranks, table)


def _live_versions(
    ranks: Sequence[Sequence[Action]], fwd: Sequence[Sequence[Version]], bwd: Sequence[Sequence[Version]]
) -> list[list[int]]:
    out: list[list[int]] = []
    for acts in ranks:
        end = len(acts)
        # the (stage, version) each F and B uses, and where: a dict of the pairs keeps the last index per key
        used = [j for j, a in enumerate(acts) if a[1] is _F or a[1] is _B]
        keys = [(s, (fwd if k is _F else bwd)[s][i]) for s, k, i in map(acts.__getitem__, used)]  # type: ignore[index]  # None: TypeError, the caller falls back
        last = dict(zip(keys, used))
        first = dict(zip(reversed(keys), reversed(used)))
        steps: dict[int, list[int]] = {}
        for j in [j for j, a in enumerate(acts) if a[1] is _STEP]:
            steps.setdefault(acts[j][0], []).append(j)
        intervals: dict[tuple[int, Version], tuple[int, int]] = {}
        for s in set(map(_stage_of, acts)):
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
        out.append(list(accumulate(diff[:end])))
    return out


def version_bound(policy: str, num_ranks: int, microbatches: int, stage: int) -> int:
    """The most weight versions stage ``stage`` keeps under ``policy`` (1F1B without flush, one stage per rank).

    The p - s micro-batches in flight at stage s span at most
    k_s = 1 + ceil((p - s - 1) / m) mini-batches. stash: k_s (one version per
    mini-batch in flight, the current one among them; p - s for PipeDream's
    m = 1); none: 1; vertical: k_0 = 1 + ceil((p - 1) / m) at every stage (the
    version a micro-batch took at stage 0 is kept until its last backward);
    2bw: 2; predict: 1 + k_s (the current weights and one prediction per
    mini-batch in flight), but 1 on the last stage, whose predictions are 0
    updates ahead. Long windows reach these counts; the tests check equality.
    """
    p, m, s = num_ranks, microbatches, stage
    in_flight = 1 + -(-(p - s - 1) // m)
    if policy == "stash":
        return in_flight
    if policy == "none":
        return 1
    if policy == "vertical":
        return 1 + -(-(p - 1) // m)
    if policy == "2bw":
        return 2
    if policy == "predict":
        return 1 if s == p - 1 else 1 + in_flight
    raise ValueError(f"unknown weight-version policy {policy!r}; expected one of {', '.join(POLICIES)}")
