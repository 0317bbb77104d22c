"""The plans a run predicts more than 15 % off: what the worker records of them, and how they are shown.

Each such plan is timed again in the same run (its repeat: a miss is judged against how far the measurement
itself moves, 15-26 % for the MLP's plans on a 2-core VM in round 9), and predicted again without each term of the
model in turn (what each term adds to it), next to the terms of its prediction.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import stagewise as sw
from stagewise.partition import LayerProfile
from stagewise.planning import search

MISS = 0.15  # a plan predicted further than this from its measurement is timed again and re-predicted term by term


def ablations(
    profile: LayerProfile, world: int, cal: Any, scale: tuple[float, float, float], common: dict[str, Any]
) -> dict[str, dict[str, sw.Plan]]:
    """The predictions again, each without one term of the model (what each term adds to a plan that misses)."""
    variants: dict[str, tuple[LayerProfile, Any, Any, dict[str, Any]]] = {
        "compute scale": (profile, cal, 1.0, common),
        "fixed cost per layer": (profile, cal, scale, {**common, "overhead": 0.0}),
        "checkpoint cost": (replace(profile, checkpoint=None), cal, scale, common),
        "layout cost": (profile, replace(cal, layouts=()), scale, common),
        "idle CPU": (profile, replace(cal, background=0.0), scale, common),
        "FSDP2 hooks": (profile, replace(cal, sharding_hooks=None), scale, common),
    }
    out = {}
    for term, (prof, calibration, k, options) in variants.items():
        found = search(prof, world, calibration=calibration, compute_scale=k, top=100_000, **options).plans
        out[term] = {p.describe(): p for p in found}
    return out


def show_misses(rows: list[dict[str, Any]], threshold: float = MISS) -> None:
    """Each plan predicted more than ``threshold`` off: its repeat, whether the miss stands beyond it, the terms of
    its prediction, and the prediction without each term."""
    missed = [r for r in rows if "measured_again" in r]
    if not missed:
        print(f"no plan predicted more than {threshold:.0%} off")
        return
    print(f"plans predicted more than {threshold:.0%} off, each timed again:")
    for r in missed:
        m1, m2, pred = r["measured"], r["measured_again"], r["predicted"]
        noise = abs(m2 / m1 - 1)
        miss = min(abs(pred / m1 - 1), abs(pred / m2 - 1))  # against the nearer of the two measurements
        stands = miss > threshold and miss > noise
        print(
            f"  {r['plan']} ({r.get('kind', '?')}): predicted {pred:.4f} s, measured {m1:.4f} then {m2:.4f} s "
            f"(repeat moved {noise:.0%}); error {pred / m1 - 1:+.0%} / {pred / m2 - 1:+.0%}: "
            + ("beyond the repeat" if stands else "within the repeat")
        )
        bd = r.get("breakdown", {})
        if bd:
            terms = ", ".join(
                f"{k} {bd[k]:.4f}"
                for k in ("simulated", "cpu_bound", "shared_cores", "compute", "grad_sync")
                if k in bd
            )
            print(f"    terms: {terms}, per step beyond the schedule {r.get('fixed_step', 0.0):.4f}")
        without = r.get("without", {})
        if without:
            print("    predicted without: " + ", ".join(f"{t} {v:.4f} ({v / m1 - 1:+.0%})" for t, v in without.items()))
