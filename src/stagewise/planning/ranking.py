"""Ranking plans, and saying why each beat the next."""

from __future__ import annotations

from dataclasses import replace

from .result import Plan, gib


def rank_key(p: Plan) -> tuple[float, float, int, int]:
    """Fastest first; then the smaller peak; then the fewer pipeline ranks and micro-batches (simpler to run)."""
    return (p.step_time, p.peak_memory, p.layout.pp * p.virtual_stages, p.microbatches)


def with_reasons(plans: list[Plan]) -> list[Plan]:
    out = []
    for k, plan in enumerate(plans):
        if k + 1 < len(plans):
            why = _why(plan, plans[k + 1])
        else:
            why = "last of the ranked plans"
        out.append(replace(plan, why=why))
    return out


def _why(a: Plan, b: Plan) -> str:
    """A short reason ``a`` ranks above ``b``: the step-time term where it gains most, or the tie-break."""
    if b.step_time - a.step_time <= 1e-9 * max(a.step_time, 1e-30):
        if a.peak_memory < b.peak_memory:
            return f"same step time as the next, lower peak memory ({gib(a.peak_memory)} vs {gib(b.peak_memory)})"
        return "same step time and memory as the next; fewer stages or micro-batches"
    gain = (b.step_time - a.step_time) / b.step_time
    terms = {
        "less pipeline idle time": (b.breakdown["pipeline_idle"] - a.breakdown["pipeline_idle"]),
        "less compute on the busiest rank": b.breakdown["compute"] - a.breakdown["compute"],
        "less exposed gradient sync": b.breakdown["grad_sync"] - a.breakdown["grad_sync"],
    }
    term = max(terms, key=lambda k: terms[k])
    detail = {
        "less pipeline idle time": f"bubble {a.bubble:.1%} vs {b.bubble:.1%}",
        "less compute on the busiest rank": f"{a.breakdown['compute']:.3g} s vs {b.breakdown['compute']:.3g} s",
        "less exposed gradient sync": f"{a.breakdown['grad_sync']:.3g} s vs {b.breakdown['grad_sync']:.3g} s",
    }[term]
    return f"{gain:.2%} faster than the next: {term} ({detail})"
