"""Ranking plans, and saying why each beat the next.

Predicted step times come from measured costs: two plans within :data:`NOISE` of each other are tied (a
profile's round-to-round spread on a quiet machine is about 1 %), and a tie goes to the smaller peak memory,
then to the fewer pipeline stages and micro-batches (simpler to run). So a 1e-17 s difference never outranks a
memory saving, and no reason reads "0.00 % faster".
"""

from __future__ import annotations

from dataclasses import replace

from .result import Plan
from .units import in_unit, unit_for

#: relative step-time difference under which two plans count as equally fast
NOISE = 0.01


def rank_key(p: Plan) -> tuple[float, float, int, int]:
    """Fastest first; then the smaller peak; then the fewer pipeline ranks and micro-batches (simpler to run)."""
    return (p.step_time, p.peak_memory, p.layout.pp * p.virtual_stages, p.microbatches)


def _tie_key(p: Plan) -> tuple[float, int, int, float]:
    return (p.peak_memory, p.layout.pp * p.virtual_stages, p.microbatches, p.step_time)


def ranked(plans: list[Plan]) -> list[Plan]:
    """Fastest first, plans within :data:`NOISE` of a group's fastest tied and ordered by memory, then simplicity."""
    ordered = sorted(plans, key=rank_key)
    out: list[Plan] = []
    k = 0
    while k < len(ordered):
        anchor = ordered[k].step_time
        j = k
        while j < len(ordered) and ordered[j].step_time <= anchor * (1 + NOISE):
            j += 1
        out += sorted(ordered[k:j], key=_tie_key)
        k = j
    return out


def with_reasons(plans: list[Plan]) -> list[Plan]:
    """Each plan with why it ranks above the next; memories in one unit, the largest peak's (as the table shows)."""
    unit = unit_for(max((p.peak_memory for p in plans if p.peak_memory < float("inf")), default=0.0))
    out = []
    for k, plan in enumerate(plans):
        if k + 1 < len(plans):
            why = _why(plan, plans[k + 1], unit)
        else:
            why = "last of the ranked plans"
        out.append(replace(plan, why=why))
    return out


def _why(a: Plan, b: Plan, unit: str) -> str:
    """A short reason ``a`` ranks above ``b``: the step-time term where it gains most, or the tie-break."""
    gain = (b.step_time - a.step_time) / b.step_time if b.step_time > 0 else 0.0
    if abs(gain) < NOISE:
        tie = f"as fast as the next within the timing noise ({a.step_time:.4g} s vs {b.step_time:.4g} s)"
        if a.peak_memory < b.peak_memory:
            return f"{tie}, lower peak memory ({in_unit(a.peak_memory, unit)} vs {in_unit(b.peak_memory, unit)})"
        if a.peak_memory == b.peak_memory:
            return f"{tie} and memory; fewer stages or micro-batches"
        return f"{tie}; {gain:.1%} faster"
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
    return f"{gain:.1%} faster than the next: {term} ({detail})"
