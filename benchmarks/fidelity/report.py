"""What a fidelity job's raw JSON says, as rows and checks (pure: plain dicts and numbers, nothing run).

:func:`summarize` turns one job (one workload on one rank count, every schedule) into a row per schedule:
the three predictions and the measured step, their errors, the simulated and metered activation peaks,
and what names a miss (:func:`causes`: compute inside the pipeline against the profile's, messages, gaps).
:func:`ranking_violations` is the ranking check, :func:`stage_rows` the split backward and the bytes per stage,
:func:`pays_checks` issue 39's "it pays" targets.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from .breakdown import COMPUTE, medians, stage_means, step_times

GOAL = 0.10  # within 10 % on time and memory, at 2 ranks
APART = 0.05  # the ranking must hold for every pair whose simulated times differ by more than this


def error(predicted: float | None, measured: float | None) -> float | None:
    """``predicted / measured - 1`` (None where either is missing or the measurement is 0)."""
    if predicted is None or not measured:
        return None
    return predicted / measured - 1


def ranking_violations(
    simulated: Mapping[str, float], measured: Mapping[str, float], apart: float = APART
) -> list[tuple[str, str]]:
    """Pairs ``(a, b)`` with ``a`` simulated faster than ``b`` by more than ``apart`` (of the faster one's time)
    that were not measured faster: the order by measured time must equal the order by simulated time there."""
    names = sorted(simulated, key=lambda n: (simulated[n], n))
    bad = []
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            if simulated[b] - simulated[a] > apart * simulated[a] and not measured[a] < measured[b]:
                bad.append((a, b))
    return bad


def profile_compute(record: Mapping[str, Any], costs: Mapping[str, Sequence[float]]) -> dict[str, float]:
    """Per kind, what the profile charges for the actions one rank ran in one step (``costs[kind][stage]``)."""
    out = dict.fromkeys(COMPUTE, 0.0)
    for key, (_, count) in record["per_stage"].items():
        kind, stage = key[0], int(key[1:])
        out[kind] += count * costs[kind][stage]
    return out


def causes(sched: Mapping[str, Any]) -> dict[str, Any]:
    """The busiest rank (most measured compute): its compute per kind measured and as the profile charges it,
    its messages and the median time per message, gaps, head + tail and CPU (medians over the timed steps)."""
    costs = sched["predicted"]["costs"]
    per_rank = []
    for rank, records in enumerate(sched["records"]):
        med = medians(records)
        charged = profile_compute(records[0], costs)  # every step runs the same actions
        per_rank.append((sum(med["compute"].values()), rank, med, charged))
    _, rank, med, charged = max(per_rank)
    per_message = med["comm"] / med["messages"] if med["messages"] else 0.0
    return {
        "rank": rank,
        "compute": med["compute"],
        "charged": charged,
        "compute_ratio": sum(med["compute"].values()) / max(sum(charged.values()), 1e-12),
        "messages": med["messages"],
        "per_message": per_message,
        "comm": med["comm"],
        "gaps": med["gaps"],
        "head_tail": med["head"] + med["tail"],
        "other": med["other"],
        "cpu": med["cpu"],
    }


def summarize(job: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One row per schedule of one job: predictions, measurement, errors, peaks and causes."""
    rows = []
    for label, sched in job["schedules"].items():
        pred = sched["predicted"]
        times = step_times(sched["records"])
        measured = statistics.median(times)
        sim_peak = max(pred["peak_bytes"])
        meas_peak = max(float(m["peak_bytes"]) for m in sched["memory"])
        row = {
            "label": label,
            "schedule": sched["schedule"],
            "stages": sched["stages"],
            "bounds": sched["bounds"],
            "steps": len(times),
            "measured": measured,
            "measured_spread": [min(times), max(times)],
            "simulated": pred["makespan"],
            "with_runtime": pred["with_runtime"],
            "shared_cores": pred.get("shared_cores"),
            "at_measured_compute": pred.get("at_measured_compute"),
            "simulated_peak": sim_peak,
            "measured_peak": meas_peak,
            "causes": causes(sched),
        }
        row["time_error"] = error(row["simulated"], measured)
        row["runtime_error"] = error(row["with_runtime"], measured)
        row["compute_error"] = error(row["at_measured_compute"], measured)
        row["memory_error"] = error(sim_peak, meas_peak)
        row["goal"] = abs(row["time_error"] or 0) <= GOAL and abs(row["memory_error"] or 0) <= GOAL
        rows.append(row)
    return rows


def _metered(memory: Sequence[Mapping[str, Any]], stage: int, field: str) -> float | None:
    """The meter's mean bytes over micro-batches (``field``: ``forward_bytes`` or ``weight_bytes``) of ``stage``,
    on the rank that holds it (None: not metered)."""
    found = [v for rank in memory for at, v in rank[field].items() if int(at.split(",")[0]) == stage]
    return statistics.fmean(found) if found else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def stage_rows(job: Mapping[str, Any], split: str = "zb-h1", whole: str = "1f1b") -> list[dict[str, Any]]:
    """Per stage of the ``split`` schedule's cut: (I + W) / B from the profile and measured in the pipelines
    (``split``'s mean I and W over ``whole``'s mean B, where the two cuts agree); the bytes a forward saves and
    the bytes W holds after I, as the cost model charges them and as the meter counted them in ``split``'s run;
    and W's share of the forward's. Empty if ``split`` was not run."""
    schedules = job["schedules"]
    if split not in schedules:
        return []
    ran = schedules[split]
    costs = ran["predicted"]["costs"]
    split_means = stage_means(ran["records"])
    same_cut = whole in schedules and schedules[whole]["bounds"] == ran["bounds"]
    whole_means = stage_means(schedules[whole]["records"]) if same_cut else {}
    rows = []
    for s in range(len(costs["F"])):
        i, w, b = split_means.get(f"I{s}"), split_means.get(f"W{s}"), whole_means.get(f"B{s}")
        saved, held = _metered(ran["memory"], s, "forward_bytes"), _metered(ran["memory"], s, "weight_bytes")
        rows.append(
            {
                "stage": s,
                "profile_ratio": _ratio(costs["I"][s] + costs["W"][s], costs["B"][s]),
                "measured_ratio": _ratio(i + w, b) if i is not None and w is not None else None,
                "profile_saved": costs["saved"][s],
                "metered_saved": saved,
                "profile_held": costs["held"][s],
                "metered_held": held,
                "profile_share": _ratio(costs["held"][s], costs["saved"][s]),
                "metered_share": _ratio(held, saved),
            }
        )
    return rows


def split_target(d_model: int) -> float:
    """Issue 39's bound on (I + W) / B: 1.05 at d >= 256, 1.15 below (the demo's d 64)."""
    return 1.05 if d_model >= 256 else 1.15


HANDWRITTEN = ("1f1b", "zb-h1", "zb-v")


def pays_checks(job: Mapping[str, Any], rows: Sequence[Mapping[str, Any]]) -> list[tuple[str, bool | None, str]]:
    """Issue 39's "it pays" targets on one job: ``(check, passed or None when it cannot be judged, figures)``."""
    by = {r["label"]: r for r in rows}
    out: list[tuple[str, bool | None, str]] = []
    base = by.get("1f1b")
    for name in ("zb-h1", "zb-v", "auto"):
        if base is None or name not in by:
            continue
        meas = by[name]["measured"] / base["measured"]
        sim = by[name]["simulated"] / base["simulated"]
        ok = meas < 1 and (1 - meas) >= 0.5 * (1 - sim)
        figures = f"measured {meas:.3f}x, simulated {sim:.3f}x" + (" (no gain simulated)" if sim >= 1 else "")
        out.append((f"{name} faster than 1f1b by at least half the simulated gain", ok, figures))
    if base is not None and "zb-h1" in by:
        share = by["zb-h1"]["measured_peak"] / base["measured_peak"]
        out.append(("zb-h1's activation peak <= 1.05x 1f1b's", share <= 1.05, f"{share:.3f}x (meter)"))
    hand = [by[n]["measured"] for n in HANDWRITTEN if n in by]
    if "auto" in by and hand:
        share = by["auto"]["measured"] / min(hand)
        out.append(("auto within 2 % of the fastest hand-written schedule", share <= 1.02, f"{share:.3f}x"))
    bound = split_target(int(job.get("d_model", 0)))
    for row in stage_rows(job):
        for source in ("profile", "measured"):
            ratio = row[f"{source}_ratio"]
            figures = "not measured" if ratio is None else f"{ratio:.3f}"
            out.append((f"stage {row['stage']}: (I+W)/B <= {bound} ({source})",
                        None if ratio is None else ratio <= bound, figures))  # fmt: skip
    return out
