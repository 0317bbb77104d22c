"""The verdict of one comparison of step times: a ratio of medians, its bootstrap interval, and what it says.

Pure (no torch). The steps of two pipelines are timed alternately, step by step, so step ``k`` of one and step
``k`` of the other saw nearly the same machine: the bootstrap resamples step *indices* (the same ones for
both), which keeps that pairing and lets a slow drift of the load cancel in the ratio (Efron and Tibshirani,
*An Introduction to the Bootstrap*, 1993, ch. 13: percentile intervals). The interval is the noise the table
is judged against: a default is "slower" only when the whole interval lies above the 2 % goal.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

#: the goal of issue 49 item 1: a default within 2 % of the best named cut
GOAL = 0.02
#: bootstrap resamples, and the interval's coverage
RESAMPLES = 2000
LEVEL = 0.90


@dataclass(frozen=True)
class Ratio:
    """``median(a) / median(b)`` and its ``LEVEL`` percentile-bootstrap interval ``[lo, hi]``."""

    value: float
    lo: float
    hi: float

    def verdict(self, same_cut: bool = False, goal: float = GOAL) -> str:
        """The verdict: "same cut" (nothing to compare), "within 2 %" (the median ratio at most ``1 + goal``),
        "within noise" (above it, but the interval reaches below it), or "slower" (the whole interval above it)."""
        if same_cut:
            return "same cut"
        if self.value <= 1 + goal:
            return f"within {goal:.0%}"
        return "within noise" if self.lo <= 1 + goal else "slower"

    def text(self) -> str:
        return f"{self.value:.3f} [{self.lo:.3f}, {self.hi:.3f}]"


def paired_ratio(
    a: Sequence[float],
    b: Sequence[float],
    *,
    unpaired: bool = False,
    resamples: int = RESAMPLES,
    level: float = LEVEL,
    seed: int = 0,
) -> Ratio:
    """The ratio of medians of ``a`` over ``b`` (steps taken in turn: ``a[k]`` beside ``b[k]``; the longer one is
    cut to the shorter) with a percentile-bootstrap interval over resampled step indices (seeded: the same
    data give the same interval). ``unpaired``: steps not taken in turn, each side resampled on its own."""
    if not a or not b:
        raise ValueError("paired_ratio: no steps to compare")
    if not 0 < level < 1:
        raise ValueError(f"paired_ratio: level must be in (0, 1), got {level}")
    if not unpaired:
        n = min(len(a), len(b))
        a, b = list(a[:n]), list(b[:n])
    rng = random.Random(seed)
    draws = []
    for _ in range(resamples):
        ia = [rng.randrange(len(a)) for _ in a]
        ib = [rng.randrange(len(b)) for _ in b] if unpaired else ia
        draws.append(statistics.median(a[i] for i in ia) / statistics.median(b[i] for i in ib))
    draws.sort()
    tail = (1 - level) / 2
    lo = draws[int(tail * (resamples - 1))]
    hi = draws[int((1 - tail) * (resamples - 1))]
    return Ratio(statistics.median(a) / statistics.median(b), lo, hi)


def spread(steps: Sequence[float]) -> float:
    """Step-to-step spread: the median absolute deviation over the median (robust to a preempted step)."""
    med = statistics.median(steps)
    return statistics.median(abs(s - med) for s in steps) / med if med else 0.0
