"""The held-out benchmark's figures from the workers' JSON (pure): errors, ranking, interval coverage."""

from __future__ import annotations

import itertools
import statistics
from typing import Any


def spread(steps: list[float]) -> float:
    """Half the interquartile range of a plan's steps (0 for fewer than 2)."""
    if len(steps) < 2:
        return 0.0
    q = statistics.quantiles(steps, n=4, method="inclusive")
    return (q[2] - q[0]) / 2


def kendall(rows: list[dict[str, Any]]) -> tuple[float, int]:
    """Kendall's tau between predicted and measured medians over the pairs of the same m and pp whose measured
    medians differ by more than twice the pooled spread; and how many pairs that is."""
    agree = disagree = 0
    for a, b in itertools.combinations(rows, 2):
        pa, pb = a["plan"], b["plan"]
        if (pa["microbatches"], pa["pp"]) != (pb["microbatches"], pb["pp"]):
            continue
        ma, mb = statistics.median(a["steps"]), statistics.median(b["steps"])
        pooled = (spread(a["steps"]) ** 2 + spread(b["steps"]) ** 2) ** 0.5
        if abs(ma - mb) <= 2 * pooled:
            continue
        if (ma - mb) * (a["predicted"] - b["predicted"]) > 0:
            agree += 1
        else:
            disagree += 1
    pairs = agree + disagree
    return ((agree - disagree) / pairs if pairs else float("nan")), pairs


def as_model(rows: list[dict[str, Any]], model: str) -> list[dict[str, Any]]:
    """The rows with ``model``'s prediction and interval as their own (``"after"``: the rows as they are;
    ``"before"``: each row's ``"before"`` figures; rows without them are left out)."""
    if model == "after":
        return rows
    return [{**r, **r[model]} for r in rows if model in r]


def summary(result: dict[str, Any], model: str = "after") -> dict[str, Any]:
    """A job's figures for ``model``'s predictions (:func:`as_model`)."""
    rows = as_model(result["plans"], model)
    errors = [r["predicted"] / statistics.median(r["steps"]) - 1 for r in rows]
    steps = [(s, r) for r in rows for s in r["steps"]]
    inside = sum(1 for s, r in steps if r["low"] <= s <= r["high"]) / len(steps) if steps else float("nan")
    widths = [(r["high"] - r["low"]) / 2 / max(spread(r["steps"]), 1e-12) for r in rows]
    tau, pairs = kendall(rows)
    return {
        "workload": result["workload"],
        "world": result["world"],
        "model": model,
        "plans": len(rows),
        "mean abs error": statistics.mean(abs(e) for e in errors) if errors else float("nan"),
        "max abs error": max((abs(e) for e in errors), default=float("nan")),
        "kendall tau": tau,
        "pairs": pairs,
        "inside interval": inside,
        "median half-width / spread": statistics.median(widths) if widths else float("nan"),
    }
