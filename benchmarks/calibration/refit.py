"""Predict a stored run's plans again with the current cost models, offline (no processes, no torch).

    .venv/bin/python -m benchmarks.calibration.refit out/regret/regret.json
    .venv/bin/python -m benchmarks.calibration.refit out/calibration/calibration.json

A job of ``benchmarks.calibration`` or ``benchmarks.regret`` keeps what its calibrating plan P gave (``kept``:
the profiles per micro-batch, P's calibrating timelines, its cut, the cores, the link's prior bandwidth);
:func:`.model.refit` calibrates both models on it again and predicts every plan, so a change to the model
can be judged against a quiet run without running it again. Per job and model: the mean and largest absolute
error against the measured medians, the plan each model picks and its regret over the sweep's best by the
sweep's own medians (the benchmark's regret times the two again; this is the sweep's figure).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from .model import MODELS, refit
from .report import measured, summary
from .space import GLOBAL_BATCH


def figures(rows: list[dict[str, Any]], model: str, p_builds: list[list[float]] | None = None) -> dict[str, Any]:
    """``model``'s mean and largest absolute error, its pick and the pick's regret by the sweep's medians, and
    the benchmark's ranking, interval and noise figures (:func:`.report.summary`; ``p_builds``: P's timed steps per
    build, which the noise floor takes)."""
    medians = [measured(r) for r in rows]
    errors = [abs(r[model][0] / m - 1) for r, m in zip(rows, medians)]
    i = min(range(len(rows)), key=lambda k: rows[k][model][0])
    plans = [{"plan": r["plan"], "steps": r["steps"], "builds": r.get("builds"), "predicted": r[model][0],
              "low": r[model][1], "high": r[model][2]} for r in rows]  # fmt: skip
    s = summary({"workload": "", "world": 0, "plans": plans, "p_builds": p_builds or []})
    return {"mae": statistics.mean(errors), "max": max(errors), "pick": i, "regret": medians[i] / min(medians) - 1,
            "tau": s["kendall tau"], "pairs": s["pairs"], "inside": s["inside interval"],
            "width": s["median half-width / spread"], "floor": s["floor mae"], "tau builds": s["kendall tau (builds)"],
            "pairs builds": s["pairs (builds)"]}  # fmt: skip


def describe(plan: dict[str, Any]) -> str:
    return f"{plan['schedule']} m{plan['microbatches']} {plan['partition']} pp{plan['pp']} dp{plan['dp']}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path, nargs="+", help="a regret.json, calibration.json or job-*.json")
    parser.add_argument(
        "--reduce-link", type=float, nargs=2, metavar=("LATENCY_S", "BYTES_PER_S"),
        help="for jobs that kept no all-reduce probe: price the replicas' all-reduce on this link (a what-if: "
        "a probe taken at another time; the table says so)",
    )  # fmt: skip
    parser.add_argument(
        "--p-swept", action="store_true",
        help="for jobs that kept no timed P: take P's steps (for the bias) from the sweep's row of P (a regret job's "
        "first) and leave that row out of the figures (a what-if; the table says so)",
    )  # fmt: skip
    parser.add_argument(
        "--one-link", action="store_true",
        help="for jobs across machines: one link for every transfer, as the models were before they fitted the link "
        "between machines apart from the one inside each (a comparison; the table says so)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    lines = [
        "| workload | ranks | link | model | plans | MAE | floor | max | tau (pairs) | tau, builds apart | inside "
        "| half-width / spread | pick | sweep regret |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for path in args.results:
        data = json.loads(path.read_text())
        for job in data.get("jobs", [data]):
            if "kept" not in job:
                print(
                    f"{path}: a {job.get('workload')} job without a 'kept' record (older run): skipped", file=sys.stderr
                )
                continue
            rows = refit(job, GLOBAL_BATCH, args.reduce_link, args.p_swept, split=not args.one_link)
            keep = job["kept"]
            note = " (all-reduce link given)" if args.reduce_link and not keep.get("reduce_link") else ""
            note += " (P timed in the sweep)" if args.p_swept and not keep.get("timed_steps") else ""
            note += " (affinity from the job's pin flag)" if job.get("pin") and not keep.get("affinity") else ""
            note += " (one link)" if args.one_link and job.get("link") is not None else ""
            for model in MODELS:
                f = figures(rows, model, job.get("p_builds"))
                name = model + note
                lines.append(
                    f"| {job['workload']} | {job['world']} | {job.get('link') or 'one machine'} "
                    f"| {name} | {len(rows)} | {f['mae']:.1%} | {f['floor']:.1%} "
                    f"| {f['max']:.1%} | {f['tau']:+.2f} ({f['pairs']}) | {f['tau builds']:+.2f} ({f['pairs builds']}) "
                    f"| {f['inside']:.0%} | {f['width']:.1f} "
                    f"| {describe(rows[f['pick']]['plan'])} | {f['regret']:+.1%} |"
                )
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
