"""The regret benchmark's figures from a worker's JSON (pure): the pick, the best, and the regret with spreads."""

from __future__ import annotations

import statistics
from typing import Any

from ..calibration.report import spread


def predicted(row: dict[str, Any], model: str = "after") -> float:
    """A row's predicted step by ``model``: ``"after"`` (the row's own ``predicted``) or ``"before"``."""
    return float(row["predicted"] if model == "after" else row[model]["predicted"])


def pick(rows: list[dict[str, Any]], model: str = "after") -> int:
    """The index of the plan the planner picks: the least predicted step by ``model``."""
    return min(range(len(rows)), key=lambda i: predicted(rows[i], model))


def best(rows: list[dict[str, Any]]) -> int:
    """The index of the sweep's best plan: the least measured median."""
    return min(range(len(rows)), key=lambda i: statistics.median(rows[i]["steps"]))


def regret(again: dict[str, list[float]]) -> dict[str, float]:
    """From the steps measured again, alternating (``{"pick": [...], "best": [...]}``): each median and spread,
    and the regret ``median(pick) / median(best) - 1`` with its spread (the two spreads over the best's median,
    combined)."""
    p, b = statistics.median(again["pick"]), statistics.median(again["best"])
    sp, sb = spread(again["pick"]), spread(again["best"])
    return {
        "pick median": p,
        "pick spread": sp,
        "best median": b,
        "best spread": sb,
        "regret": p / b - 1,
        "regret spread": (sp**2 + sb**2) ** 0.5 / b,
    }


def tie(rows: list[dict[str, Any]], pp: int = 2, dp: int = 2) -> dict[str, float] | None:
    """Whether the ``pp x dp`` plans' tie in the model (4 processes on 2 cores: one pipeline rank's replicas fill
    both cores, so a bubble costs nothing and every such plan of one total work predicts alike) holds in the
    run: the relative range of their predicted steps, of their measured medians, and the pooled relative
    spread of their steps. Measured range above twice the pooled spread: the plans differ, the tie is the
    model's (None without such plans)."""
    same = [r for r in rows if r["plan"]["pp"] == pp and r["plan"]["dp"] == dp and len(r["steps"]) > 1]
    if len(same) < 2:
        return None
    predicted = [r["predicted"] for r in same]
    medians = [statistics.median(r["steps"]) for r in same]
    pooled = (sum((spread(r["steps"]) / m) ** 2 for r, m in zip(same, medians)) / len(same)) ** 0.5
    return {
        "plans": len(same),
        "predicted range": max(predicted) / min(predicted) - 1,
        "measured range": max(medians) / min(medians) - 1,
        "pooled spread": pooled,
    }


def table(results: list[dict[str, Any]]) -> list[str]:
    """One markdown row per workload and model (``after``, then ``before`` where the job has it), then the
    pp 2 x dp 2 tie per workload (:func:`tie`)."""
    lines = [
        "| workload | model | plans | planner's pick | sweep's best | pick ms (spread) | best ms (spread) "
        "| regret (spread) |",
        "|---|---|---:|---|---|---:|---:|---:|",
    ]
    for r in results:
        for model, key in (("after", "pick"), ("before", "pick before")):
            if key not in r["again"]:
                continue
            g = regret({"pick": r["again"][key], "best": r["again"]["best"]})
            lines.append(
                f"| {r['workload']} | {model} | {len(r['plans'])} | {r[key]} | {r['best']} "
                f"| {g['pick median'] * 1e3:.1f} ({g['pick spread'] * 1e3:.1f}) "
                f"| {g['best median'] * 1e3:.1f} ({g['best spread'] * 1e3:.1f}) "
                f"| {g['regret']:+.1%} ({g['regret spread']:.1%}) |"
            )
    for r in results:
        t = tie(r["plans"])
        if t is not None:
            lines.append(
                f"\n{r['workload']}: {t['plans']} pp 2 x dp 2 plans, predicted range {t['predicted range']:.1%}, "
                f"measured medians' range {t['measured range']:.1%}, pooled spread {t['pooled spread']:.1%}"
            )
    return lines
