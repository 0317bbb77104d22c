"""The regret benchmark's figures from a worker's JSON (pure): the pick, the best, and the regret with spreads."""

from __future__ import annotations

import statistics
from typing import Any

from ..calibration.report import spread


def pick(rows: list[dict[str, Any]]) -> int:
    """The index of the plan the planner picks: the least predicted step."""
    return min(range(len(rows)), key=lambda i: rows[i]["predicted"])


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


def table(results: list[dict[str, Any]]) -> list[str]:
    """One markdown row per workload."""
    lines = [
        "| workload | plans | planner's pick | sweep's best | pick ms (spread) | best ms (spread) | regret (spread) |",
        "|---|---:|---|---|---:|---:|---:|",
    ]
    for r in results:
        g = r["regret"]
        lines.append(
            f"| {r['workload']} | {len(r['plans'])} | {r['pick']} | {r['best']} "
            f"| {g['pick median'] * 1e3:.1f} ({g['pick spread'] * 1e3:.1f}) "
            f"| {g['best median'] * 1e3:.1f} ({g['best spread'] * 1e3:.1f}) "
            f"| {g['regret']:+.1%} ({g['regret spread']:.1%}) |"
        )
    return lines
