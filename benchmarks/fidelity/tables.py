"""The fidelity report as markdown: per job a goal table, a causes table, the ranking check and the split
backward per stage; for ``--pays`` the ratios to 1F1B and the targets (pure: strings from :mod:`.report`'s
rows)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .report import GOAL, HANDWRITTEN, ranking_violations, split_target, stage_rows


def _ms(x: float | None) -> str:
    return "" if x is None else f"{x * 1e3:.1f}"


def _pct(x: float | None) -> str:
    return "" if x is None else f"{x:+.1%}"


def _mb(x: float | None) -> str:
    return "" if x is None else f"{x / 2**20:.2f}"


def _share(x: float | None) -> str:
    return "" if x is None else f"{x:.0%}"


def _ratio(x: float | None) -> str:
    return "" if x is None else f"{x:.2f}"


def _kib(x: float | None) -> str:
    return "" if x is None else f"{x / 1024:.0f}"


def _cores(x: float | None) -> str:
    return "not measured" if x is None else f"{x:.2f}"


def heading(job: Mapping[str, Any], oversubscribed: bool) -> str:
    cal = job["calibration"]
    mark = ", **oversubscribed** (more ranks than cores)" if oversubscribed else ""
    bandwidth = "unlimited" if cal["bandwidth"] is None else f"{cal['bandwidth'] / 1e9:.2f} GB/s"
    return (
        f"### {job['title']}, {job['ranks']} ranks{mark}\n\n"
        f"{job['microbatches']} micro-batches of {job['microbatch']}; link {cal['latency'] * 1e6:.0f} us + "
        f"bytes / {bandwidth}; the runtime's cost per action {cal['action'] * 1e6:.0f} us, per step "
        f"{cal['step'] * 1e3:.2f} ms; cores shared {_cores(cal['cores'])}; {_scale(cal.get('compute_scale'))}; "
        f"job {job['seconds']:.0f} s."
    )


def _scale(scale: Sequence[float] | None) -> str:
    if not scale:
        return "compute scale not measured (k = 1)"
    return "compute scale on the group over the profile " + ", ".join(
        f"{k} {v:.2f}" for k, v in zip(("k_F", "k_B", "k_IW"), scale)
    )


def goal_table(rows: Sequence[Mapping[str, Any]], judged: bool) -> str:
    """Simulated against measured, time and activation peak; ``judged``: the goal applies (2 ranks)."""
    head = (
        "| schedule | stages | simulated ms | measured ms (min-max) | error | simulated peak MiB | metered peak MiB "
        f"| error | within {GOAL:.0%} |\n|---|---:|---:|---:|---:|---:|---:|---:|---|"
    )
    lines = [head]
    for r in rows:
        lo, hi = r["measured_spread"]
        goal = ("yes" if r["goal"] else "**no**") if judged else "(not judged)"
        lines.append(
            f"| {r['label']} | {r['stages']} | {_ms(r['simulated'])} | {_ms(r['measured'])} ({_ms(lo)}-{_ms(hi)}) "
            f"| {_pct(r['time_error'])} | {_mb(r['simulated_peak'])} | {_mb(r['measured_peak'])} "
            f"| {_pct(r['memory_error'])} | {goal} |"
        )
    return "\n".join(lines)


def causes_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """What names a miss: the planner's prediction (the runtime's costs, the compute scaled by the group's
    factors), the prediction at the compute measured in the pipeline,
    and the busiest rank's step taken apart."""
    head = (
        "| schedule | planner's (+ runtime, x k) ms (error) | at measured compute ms (error) "
        "| busiest rank: compute measured / profile ms (F, I, W, B ratios) "
        "| messages x us | gaps ms | head + tail ms | CPU ms |\n"
        "|---|---:|---:|---|---:|---:|---:|---:|"
    )
    lines = [head]
    for r in rows:
        c = r["causes"]
        kinds = ", ".join(
            f"{k} {c['compute'][k] / c['charged'][k]:.2f}" for k in ("F", "I", "W", "B") if c["charged"][k] > 0
        )
        measured, charged = sum(c["compute"].values()), sum(c["charged"].values())
        lines.append(
            f"| {r['label']} | {_ms(r['with_runtime'])} ({_pct(r['runtime_error'])}) "
            f"| {_ms(r['at_measured_compute'])} ({_pct(r['compute_error'])}) "
            f"| rank {c['rank']}: {_ms(measured)} / {_ms(charged)} ({kinds}) "
            f"| {c['messages']:.0f} x {c['per_message'] * 1e6:.0f} | {_ms(c['gaps'])} | {_ms(c['head_tail'])} "
            f"| {_ms(c['cpu'])} |"
        )
    return "\n".join(lines)


def ranking_line(rows: Sequence[Mapping[str, Any]]) -> str:
    sim = {r["label"]: r["simulated"] for r in rows}
    meas = {r["label"]: r["measured"] for r in rows}
    pairs = sum(1 for a in sim for b in sim if sim[b] - sim[a] > 0.05 * sim[a])
    bad = ranking_violations(sim, meas)
    listed = "; ".join(
        f"{a} simulated {_ms(sim[a])} < {b} {_ms(sim[b])} but measured {_ms(meas[a])} vs {_ms(meas[b])}" for a, b in bad
    )
    return f"Ranking: {pairs} pairs more than 5 % apart by simulation, {len(bad)} ordered otherwise when measured" + (
        f": {listed}." if bad else "."
    )


def stage_table(job: Mapping[str, Any]) -> str:
    """Per stage: (I + W) / B and the bytes F saves and W holds, the cost model's (profile) and the meter's."""
    rows = stage_rows(job)
    if not rows:
        return ""
    bound = split_target(int(job.get("d_model", 0)))
    lines = [
        f"Per stage (zb-h1's I and W, 1f1b's B, zb-h1's meter; goal (I+W)/B <= {bound}):\n",
        "| stage | (I+W)/B profile | (I+W)/B measured | F saves KiB profile / metered "
        "| W holds KiB profile / metered | W holds / F saves profile / metered |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['stage']} | {_ratio(r['profile_ratio'])} | {_ratio(r['measured_ratio'])} "
            f"| {_kib(r['profile_saved'])} / {_kib(r['metered_saved'])} | {_kib(r['profile_held'])} / "
            f"{_kib(r['metered_held'])} | {_share(r['profile_share'])} / {_share(r['metered_share'])} |"
        )
    return "\n".join(lines)


def job_section(job: Mapping[str, Any], rows: Sequence[Mapping[str, Any]], oversubscribed: bool) -> str:
    parts = [heading(job, oversubscribed), goal_table(rows, judged=job["ranks"] == 2 and not oversubscribed)]
    parts += [causes_table(rows), ranking_line(rows), chosen_line(job), stage_table(job)]
    return "\n\n".join(p for p in parts if p)


def chosen_line(job: Mapping[str, Any]) -> str:
    """What ``schedule="auto"`` chose and why, on its own profile (the schedule's ``meta["auto"]``); "" without."""
    why = job.get("schedules", {}).get("auto", {}).get("chosen")
    return f"auto chose, on its own profile: {why}." if why else ""


def pays_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """Per schedule: measured and simulated step, each over 1F1B's, and the metered peak over 1F1B's."""
    by = {r["label"]: r for r in rows}
    base = by.get("1f1b")
    if base is None:
        return ""
    lines = [
        "| schedule | measured ms | measured / 1f1b | simulated ms | simulated / 1f1b | metered peak / 1f1b |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name in (*HANDWRITTEN, "auto"):
        if name in by:
            r = by[name]
            lines.append(
                f"| {name} | {_ms(r['measured'])} | {r['measured'] / base['measured']:.3f} | {_ms(r['simulated'])} "
                f"| {r['simulated'] / base['simulated']:.3f} | {r['measured_peak'] / base['measured_peak']:.3f} |"
            )
    return "\n".join(lines)


def checks_table(checks: Sequence[tuple[str, bool | None, str]]) -> str:
    lines = ["| target | met | figures |", "|---|---|---|"]
    for what, ok, figures in checks:
        lines.append(f"| {what} | {'' if ok is None else ('yes' if ok else '**no**')} | {figures} |")
    return "\n".join(lines)
