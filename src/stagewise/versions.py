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
from dataclasses import dataclass
from typing import NamedTuple

from .actions import Action, Kind

POLICIES = ("stash", "none", "vertical", "2bw", "predict")


class Version(NamedTuple):
    """W^(base) when ``ahead`` is 0; the prediction from W^(base) ``ahead`` updates ahead otherwise."""

    base: int
    ahead: int = 0

    def __str__(self) -> str:
        return f"v{self.base}" if self.ahead == 0 else f"v{self.base}+{self.ahead}"


@dataclass(frozen=True)
class VersionTable:
    """For every (stage, micro-batch): the version its F uses and the version its backward differentiates.

    ``forward[s][i]`` / ``backward[s][i]``; ``recompute_backward`` is True when a
    backward must recompute its forward at its own version (policy ``none``).
    ``release[s]`` maps an action of stage s (its text form, e.g. ``"1B3"``) to
    the versions nobody uses after it; ``keep_at_step[s][c]`` is True when W^(c)
    is used after the STEP that replaces it (so it must be copied before the step).
    """

    policy: str
    minibatches: int
    microbatches: int
    forward: tuple[tuple[Version, ...], ...]
    backward: tuple[tuple[Version, ...], ...]
    release: tuple[dict[str, tuple[Version, ...]], ...]
    keep_at_step: tuple[tuple[bool, ...], ...]

    @property
    def recompute_backward(self) -> bool:
        return self.policy == "none"

    @property
    def num_stages(self) -> int:
        return len(self.forward)

    def minibatch_of(self, microbatch: int) -> int:
        return microbatch // self.microbatches

    def labels(self) -> dict[str, str]:
        """``{"1F3": "3v1", ...}``: each compute action's micro-batch and the version it uses (for pictures)."""
        out = {}
        for s in range(self.num_stages):
            for i, (f, b) in enumerate(zip(self.forward[s], self.backward[s])):
                out[f"{s}F{i}"] = f"{i}{f}"
                out[f"{s}B{i}"] = f"{i}{b}"
        return out


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
