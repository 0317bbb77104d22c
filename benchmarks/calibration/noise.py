"""The measurement's own noise, from plans built several times (pure): what a perfect model would score.

A plan's step is not one number: the same plan built again (a fresh ``Pipeline``, its processes the same)
runs at another level, 6-14 % apart on this machine (the kept quiet runs, identical plans reached by two
partition rules). So the benchmark builds each plan ``R`` times, interleaved with the others (round after
round: drift between builds falls on every plan alike), and measures:

* a plan's **level**: the geometric mean of its builds' medians (the log of the level is the mean of the
  logs, whose standard error is the between-build sd over ``sqrt R``);
* the **between-build spread** ``s_b``: the pooled sample sd of the log build medians within each plan
  (degrees of freedom: the builds less one, summed over the plans);
* the **within-build spread** ``s_w``: the pooled sd of the log steps within each build;
* the **noise floor**: the mean absolute error a model that knew every plan's true level would show against
  these measured levels. Each Q's level is off by ``s_b / sqrt R_Q``, and the calibrating plan P's by
  ``s_b / sqrt R_P`` on every prediction at once (P sets the level of the calibration); the difference of
  two independent normal errors has an absolute mean of ``sqrt(2 / pi)`` x its sd:
  ``floor = sqrt(2/pi) sqrt(s_b^2 / R_Q + s_b^2 / R_P)`` (relative errors as logs: fine at these sizes);
* the **oracle's coverage**: the share of a plan's measured steps inside an interval centred on its own
  measured level, at the goal's half-width (``factor`` x the plan's step spread): the best coverage that
  width allows whatever the model.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

#: a plan's builds: per build, its measured steps (seconds)
Builds = Sequence[Sequence[float]]


def level(builds: Builds) -> float:
    """The geometric mean of the builds' medians (module docstring)."""
    medians = [statistics.median(b) for b in builds if b]
    if not medians or min(medians) <= 0:
        raise ValueError(f"level: builds need steps > 0, got {[list(b) for b in builds]!r}")
    if len(medians) == 1:
        return medians[0]
    return math.exp(sum(math.log(m) for m in medians) / len(medians))


def _pooled(groups: Sequence[Sequence[float]]) -> tuple[float, int]:
    """The pooled sample sd of values within their groups, and its degrees of freedom (0, 0 when none)."""
    squares, df = 0.0, 0
    for g in groups:
        if len(g) < 2:
            continue
        mean = sum(g) / len(g)
        squares += sum((x - mean) ** 2 for x in g)
        df += len(g) - 1
    return (math.sqrt(squares / df), df) if df else (0.0, 0)


def between_builds(plans: Sequence[Builds]) -> tuple[float, int]:
    """The pooled sd of the log build medians within each plan, and its degrees of freedom."""
    return _pooled([[math.log(statistics.median(b)) for b in builds if b] for builds in plans])


def within_builds(plans: Sequence[Builds]) -> tuple[float, int]:
    """The pooled sd of the log steps within each build, and its degrees of freedom."""
    return _pooled([[math.log(s) for s in b] for builds in plans for b in builds])


def noise_floor(between: float, builds_q: float, builds_p: float) -> float:
    """The mean absolute (log) error of a perfect model against levels measured from ``builds_q`` builds of each
    plan, calibrated on ``builds_p`` builds of P, at a between-build sd ``between`` (module docstring)."""
    if builds_q < 1 or builds_p < 1:
        raise ValueError(f"noise_floor: builds must be >= 1, got {builds_q}, {builds_p}")
    return math.sqrt(2.0 / math.pi) * between * math.sqrt(1.0 / builds_q + 1.0 / builds_p)


def oracle_coverage(plans: Sequence[Builds], spreads: Sequence[float], factor: float = 2.0) -> float:
    """The share of every plan's steps within ``factor`` x its spread (``spreads``, seconds, one per plan) of its
    own :func:`level`: what an interval of that half-width covers when its centre is right."""
    inside = total = 0
    for builds, s in zip(plans, spreads, strict=True):
        centre = level(builds)
        for b in builds:
            inside += sum(1 for x in b if abs(x - centre) <= factor * s)
            total += len(b)
    return inside / total if total else float("nan")
