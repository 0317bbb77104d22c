"""The held-out benchmark's figures from the workers' JSON (pure): errors, ranking, interval coverage, and the
measurement's own noise (:mod:`.noise`) beside them.

A row is one plan: its prediction and interval, and its measured steps, per build where the job built it
several times (``"builds"``: a list per build; ``"steps"``: all of them). A plan's measured step is its
:func:`.noise.level` (one build: the median of its steps).
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Callable
from typing import Any

from .noise import between_builds, level, noise_floor, oracle_coverage, within_builds


def spread(steps: list[float]) -> float:
    """Half the interquartile range of a plan's steps (0 for fewer than 2)."""
    if len(steps) < 2:
        return 0.0
    q = statistics.quantiles(steps, n=4, method="inclusive")
    return (q[2] - q[0]) / 2


def builds_of(row: dict[str, Any]) -> list[list[float]]:
    """A row's steps per build (a row of one build: its steps as the one build)."""
    return [list(b) for b in row.get("builds") or [row["steps"]]]


def measured(row: dict[str, Any]) -> float:
    return level(builds_of(row))


def kendall(
    rows: list[dict[str, Any]], separated: Callable[[dict[str, Any], dict[str, Any]], bool] | None = None
) -> tuple[float, int]:
    """Kendall's tau between predicted and measured steps over the pairs of the same m and pp that are
    ``separated``, and how many pairs that is. Default (the issue's judge): measured steps more than twice the
    pooled spread apart (each plan's :func:`spread` over all its steps, every build's)."""

    def by_steps(a: dict[str, Any], b: dict[str, Any]) -> bool:
        pooled = (spread(a["steps"]) ** 2 + spread(b["steps"]) ** 2) ** 0.5
        return abs(measured(a) - measured(b)) > 2 * pooled

    agree = disagree = 0
    for a, b in itertools.combinations(rows, 2):
        pa, pb = a["plan"], b["plan"]
        if (pa["microbatches"], pa["pp"]) != (pb["microbatches"], pb["pp"]) or not (separated or by_steps)(a, b):
            continue
        if (measured(a) - measured(b)) * (a["predicted"] - b["predicted"]) > 0:
            agree += 1
        else:
            disagree += 1
    pairs = agree + disagree
    return ((agree - disagree) / pairs if pairs else float("nan")), pairs


def apart_by_builds(between: float) -> Callable[[dict[str, Any], dict[str, Any]], bool]:
    """Two plans whose levels differ (in log) by more than twice their pooled standard error, each
    ``between / sqrt(its builds)``: pairs the measurement itself can order."""

    def separated(a: dict[str, Any], b: dict[str, Any]) -> bool:
        se = between * math.sqrt(1 / len(builds_of(a)) + 1 / len(builds_of(b)))
        return abs(math.log(measured(a) / measured(b))) > 2 * se

    return separated


def as_model(rows: list[dict[str, Any]], model: str) -> list[dict[str, Any]]:
    """The rows with ``model``'s prediction and interval as their own (``"after"``: the rows as they are;
    ``"before"``: each row's ``"before"`` figures; rows without them are left out)."""
    if model == "after":
        return rows
    return [{**r, **r[model]} for r in rows if model in r]


def noise(result: dict[str, Any]) -> dict[str, Any]:
    """A job's measurement noise (:mod:`.noise`): the between- and within-build sd (log) with their degrees of
    freedom (P's builds pooled in), the builds per plan and of P, the noise floor of the mean absolute error,
    the oracle's coverage at twice the step spread, and the drift: per round, the mean log of the plans' build
    medians over their levels (a machine that slows down during the job shows a rising row)."""
    plans = [builds_of(r) for r in result["plans"]]
    p_builds = [list(b) for b in result.get("p_builds") or []]
    between, df_b = between_builds([*plans, p_builds] if p_builds else plans)
    within, df_w = within_builds(plans)
    r_q = statistics.median([len(b) for b in plans]) if plans else 1
    rounds = max((len(b) for b in plans), default=0)
    drift = [statistics.mean(math.log(statistics.median(b[r]) / level(b)) for b in plans if len(b) > r and b[r])
             for r in range(rounds)] if rounds > 1 else []  # fmt: skip
    r_p = max(len(p_builds), 1)
    return {
        "between sd": between, "between df": df_b, "within sd": within, "within df": df_w,
        "builds": r_q, "p builds": r_p, "floor mae": noise_floor(between, r_q, r_p) if df_b else float("nan"),
        "oracle inside": oracle_coverage(plans, [spread([s for b in p for s in b]) for p in plans]),
        "round drift": drift,
    }  # fmt: skip


def summary(result: dict[str, Any], model: str = "after") -> dict[str, Any]:
    """A job's figures for ``model``'s predictions (:func:`as_model`), with the measurement's noise (:func:`noise`)
    and Kendall's tau over the pairs the builds can order (:func:`apart_by_builds`)."""
    rows = as_model(result["plans"], model)
    errors = [r["predicted"] / measured(r) - 1 for r in rows]
    steps = [(s, r) for r in rows for s in r["steps"]]
    inside = sum(1 for s, r in steps if r["low"] <= s <= r["high"]) / len(steps) if steps else float("nan")
    widths = [(r["high"] - r["low"]) / 2 / max(spread(r["steps"]), 1e-12) for r in rows]
    tau, pairs = kendall(rows)
    nan = float("nan")
    spread_of = noise(result) if rows else {"between sd": nan, "between df": 0, "within sd": nan, "within df": 0,
                                             "builds": 0, "p builds": 0, "floor mae": nan,
                                             "oracle inside": nan}  # fmt: skip
    tau_b, pairs_b = (nan, 0)
    if spread_of["between df"]:
        tau_b, pairs_b = kendall(rows, apart_by_builds(spread_of["between sd"]))
    return {
        "workload": result["workload"],
        "world": result["world"],
        "model": model,
        "plans": len(rows),
        "mean abs error": statistics.mean(abs(e) for e in errors) if errors else float("nan"),
        "max abs error": max((abs(e) for e in errors), default=float("nan")),
        "kendall tau": tau,
        "pairs": pairs,
        "kendall tau (builds)": tau_b,
        "pairs (builds)": pairs_b,
        "inside interval": inside,
        "median half-width / spread": statistics.median(widths) if widths else float("nan"),
        **spread_of,
    }


def one_build(result: dict[str, Any]) -> dict[str, Any]:
    """``result`` as a benchmark of one build would have measured it: each plan's first build only, predicted
    from the first build of P alone (each row's ``"first"`` figures, made before any Q ran)."""
    rows = [{**r, **r["first"], "builds": [r["builds"][0]], "steps": list(r["builds"][0])}
            for r in result["plans"] if r.get("first") and r.get("builds")]  # fmt: skip
    return {**result, "plans": rows, "p_builds": (result.get("p_builds") or [])[:1]}


def one_build_summary(result: dict[str, Any]) -> dict[str, Any]:
    """:func:`summary` of :func:`one_build`, its noise figures from every build (one build cannot measure the
    between-build spread): the floor of a benchmark of one build per plan, tau over the pairs it could order."""
    full, single = noise(result), one_build(result)
    rows = single["plans"]
    tau, pairs = kendall(rows, apart_by_builds(full["between sd"])) if full["between df"] else (float("nan"), 0)
    return {**summary(single), "model": "after, 1 build", "between sd": full["between sd"],
            "between df": full["between df"], "floor mae": noise_floor(full["between sd"], 1, 1),
            "kendall tau (builds)": tau, "pairs (builds)": pairs}  # fmt: skip
