"""How good are the planner's predictions? Run planned layouts on local gloo ranks and compare.

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.plan_accuracy [--ranks 4 8] [--plans 7] [--steps 5]

For two models (the demo GPT, untied head; an MLP with 16-fold uneven
widths) rank 0 profiles, ``sw.calibrate()`` measures the group,
``sw.runtime.measure_compute_scale()`` the runtime's compute against the profile, the
planner searches (calibrated and scaled, on the calibration's cores), and the
top 3 plans, a spread of poorer ones and (``--per-layout``, the default) each
layout's best plan are run. Each plan's step is measured as the planner
predicts it - steps back to back, the slowest rank's time per step (see
``stagewise.Plan``), the median of --steps timed steps after warm-up ones -
and, beside it, from a barrier before each step (how rounds 1-9 measured).
Prints predicted (calibrated; as round 5 did, "before"; and bare: profile +
link only) vs measured step time and peak activation bytes per plan, the mean
absolute error and the Spearman rank correlation, and the error per kind of
layout (pipeline only, data-parallel, sharded), at each process count given. Each
plan predicted more than 15 % off is timed again in the same run (the repeat its
miss is judged against) and predicted again without each term of the model
(:mod:`.misses`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import tempfile
from collections.abc import Iterable
from pathlib import Path

from .._launch import environ, torchrun
from .misses import MISS, show_misses


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rho: Pearson's correlation of the ranks (ties get their mean rank)."""

    def ranks(xs: list[float]) -> list[float]:
        order = sorted(range(len(xs)), key=lambda i: xs[i])
        out = [0.0] * len(xs)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    ra, rb = ranks(a), ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / var if var else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.plan_accuracy", description=(__doc__ or "").split("\n")[0]
    )
    parser.add_argument("--ranks", type=int, nargs="+", default=[4], help="process counts, one run each")
    parser.add_argument("--plans", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None, help="also write the raw report here")
    parser.add_argument(
        "--miss", type=float, default=MISS, help="time again and re-predict plans further off than this (0.15)"
    )
    parser.add_argument("--show", type=Path, default=None, help="print a saved report instead of running")
    parser.add_argument("--models", default="gpt,mlp", help="which models, comma-separated")
    parser.add_argument(
        "--same-plans",
        type=Path,
        default=None,
        help="time the plans of this earlier report (its --json) again and compare the two runs' measurements",
    )
    parser.add_argument(
        "--per-layout",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time each layout's best plan (default: on)",
    )
    args = parser.parse_args()
    same = json.loads(args.same_plans.read_text()) if args.same_plans is not None else None
    if args.show is not None:
        show(json.loads(args.show.read_text()), args.ranks[0], None, same)
        return
    for ranks in args.ranks:
        load = os.getloadavg()
        report = run(args, ranks)
        if args.json is not None:
            path = (
                args.json
                if len(args.ranks) == 1
                else args.json.with_name(f"{args.json.stem}-{ranks}{args.json.suffix}")
            )
            path.write_text(json.dumps(report, indent=1))
        print(f"\n=== {ranks} processes ===")
        show(report, ranks, load, same)


def run(args: argparse.Namespace, ranks: int) -> dict:
    """One torchrun job of ``ranks`` workers; rank 0's report."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.json"
        flags = ["--out", str(out), "--plans", str(args.plans), "--steps", str(args.steps), "--models", args.models]
        if args.same_plans is not None:
            flags += ["--same-plans", str(args.same_plans.resolve())]
        flags += ["--per-layout" if args.per_layout else "--no-per-layout", "--miss", str(args.miss)]
        cmd = torchrun(ranks, "benchmarks.plan_accuracy.worker", flags)
        subprocess.run(cmd, check=True, env=environ(OMP_NUM_THREADS="1"))
        return json.loads(out.read_text())


def show(report: dict, ranks: int, load: tuple[float, float, float] | None, same: dict | None = None) -> None:
    """Print the report: the calibration, then per model predicted vs measured, errors and rank correlations.

    The predictions use the idle CPU measured once the chosen plans' meshes exist (``predicted_at_calibration``
    in the JSON keeps the ones with calibrate()'s)."""
    _show_calibration(report, ranks, load)
    for model, data in report["models"].items():
        rows = data["rows"]
        print(f"\n{model}: {data['candidates']} candidates, {data['simulated']} simulated; {_conditions(data, rows)}")
        print(
            f"{'#':>3}  {'predicted s':>11}  {'measured s':>10}  {'err':>6}  {'bare s':>8}  {'err':>6}  "
            f"{'act pred':>9}  {'act meas':>9}  {'cpu/comp':>8}  plan"
        )
        for r in rows:
            _show_row(r)
        _show_errors(rows)
        by_kind(rows)
        show_misses(rows, report.get("miss", MISS))
        repeatability(rows, same["models"].get(model) if same is not None else None)


def _show_calibration(report: dict, ranks: int, load: tuple[float, float, float] | None) -> None:
    cal = report["calibration"]
    lat, bw = cal["intra"]
    print(
        f"{ranks} ranks on {report['cores']:.2f} effective cores (2 nominal), load average "
        f"{'?' if load is None else f'{load[0]:.1f}'} (before) / {os.getloadavg()[0]:.1f} (after)"
    )
    print(
        f"calibration: link latency {lat * 1e6:.0f} us, bandwidth {bw / 1e6:.0f} MB/s; "
        f"{cal['action'] * 1e3:.2f} ms per action, {cal['step'] * 1e3:.2f} ms per step;"
    )
    print(
        f"  FSDP2 {cal['sharding_fixed'] * 1e3:.2f} ms per unit + {cal['sharding_per_byte'] * 1e9:.2f} ns per byte "
        f"on {cal['sharding_group']} ranks, hooks {(cal.get('sharding_hooks') or 0.0) * 1e6:.0f} us per unit and "
        f"micro-batch; idle CPU per process {cal.get('background', 0.0):.1%} of a core"
    )


def _conditions(data: dict, rows: list[dict]) -> str:
    """What a model's plans were timed under: steps, cores, compute scale, idle CPU, core speed."""
    cores = f", {data['cores']:.2f} cores on its work" if "cores" in data else ""
    if "compute_scale" in data:
        names = ("F", "B", "I+W")
        cores += ", compute scale " + " ".join(f"{n} {k:.2f}" for n, k in zip(names, data["compute_scale"]))
    if "background" in data:  # measured again once the chosen plans' meshes exist; the predictions use it
        cores += f", idle CPU {data['background']:.1%} of a core per process with its meshes"
    if "core_seconds" in data:  # a fixed workload's CPU time when probing over when the plans were timed
        before, after = data["core_seconds"]
        cores += f", core speed while timing {before / after:.2f}x that around the probe"
    return f"median of {rows[0]['runs']} steps{cores}"


def _show_row(r: dict) -> None:
    err = (r["predicted"] - r["measured"]) / r["measured"]
    bare = r["bare"]
    bare_err = (bare - r["measured"]) / r["measured"] if bare is not None else math.nan
    meas = r["measured_activations"]
    shown = f"{meas / 1e6:>8.2f}M" if meas is not None else f"{'n/a':>9}"
    # the busiest rank's CPU seconds in a step over the compute the profile gives it (older reports: n/a)
    inflate = r["cpu_busiest"] / r["compute_busiest"] if r.get("compute_busiest") else math.nan
    print(
        f"{r['rank']:>3}  {r['predicted']:>11.4f}  {r['measured']:>10.4f}  {err:>+6.0%}  "
        f"{bare if bare is not None else math.nan:>8.4f}  {bare_err:>+6.0%}  "
        f"{r['predicted_activations'] / 1e6:>8.2f}M  {shown}  {inflate:>8.2f}  {r['plan']}"
        f"{' [cores shared]' if r['cpu_bound'] else ''}"
    )


def _show_errors(rows: list[dict]) -> None:
    """Mean absolute errors and Spearman's rho of the predictions (calibrated, before, bare) and of the memory."""
    errors = [abs((r["predicted"] - r["measured"]) / r["measured"]) for r in rows]
    bare_errors = [
        abs((r["bare"] - r["measured"]) / r["measured"]) if r["bare"] is not None else math.nan for r in rows
    ]
    before_errors = [(r["predicted_before"], r["measured"]) for r in rows if r.get("predicted_before") is not None]
    mem_errors = [  # the meter does not see what a recompute re-materialises
        abs((r["predicted_activations"] - r["measured_activations"]) / r["measured_activations"])
        for r in rows
        if r["measured_activations"] and "recompute off" in r["plan"]
    ]
    rho = spearman([r["predicted"] for r in rows], [r["measured"] for r in rows])
    mem = sum(mem_errors) / max(len(mem_errors), 1)
    print(f"step time: mean abs error {sum(errors) / len(errors):.0%}, Spearman {rho:.2f}")
    if before_errors:  # the model before the compute scale, in the same run
        mean = sum(abs(p - m) / m for p, m in before_errors) / len(before_errors)
        rho_before = spearman([p for p, _ in before_errors], [m for _, m in before_errors])
        print(
            f"before (round 5: cores on the model's work, no scale): mean abs error {mean:.0%}, "
            f"Spearman {rho_before:.2f}"
        )
    ok = [(e, r) for e, r in zip(bare_errors, rows) if not math.isnan(e)]
    rho_bare = spearman([r["bare"] for _, r in ok], [r["measured"] for _, r in ok])
    print(
        f"bare (profile + link only): mean abs error {sum(e for e, _ in ok) / max(len(ok), 1):.0%}, "
        f"Spearman {rho_bare:.2f}"
    )
    print(f"activation peak: mean abs error {mem:.0%} ({len(mem_errors)} measured without recompute)")


def by_kind(rows: list[dict]) -> None:
    """The step time's mean absolute and mean signed error per kind of layout (pipeline only, data-parallel,
    sharded), against the back-to-back measurement and, where the report has it, the one from a barrier."""
    kinds: dict[str, list[dict]] = {}
    for r in rows:
        kinds.setdefault(r.get("kind", "?"), []).append(r)
    for kind, group in sorted(kinds.items()):
        err = [(r["predicted"] - r["measured"]) / r["measured"] for r in group]
        predicted, measured = sum(r["predicted"] for r in group), sum(r["measured"] for r in group)
        line = (
            f"{kind}: {len(group)} plans, predicted {predicted:.3f} s vs measured {measured:.3f} s in all, "
            f"mean abs error {_mean(map(abs, err)):.0%}, signed {_mean(err):+.0%}, "
            f"within 15 %: {sum(abs(e) <= 0.15 for e in err)} of {len(group)}"
        )
        if all("measured_barrier" in r for r in group):
            barrier = [(r["predicted"] - r["measured_barrier"]) / r["measured_barrier"] for r in group]
            line += f" (from a barrier: {_mean(map(abs, barrier)):.0%}, signed {_mean(barrier):+.0%})"
        print(line)


def _mean(values: Iterable[float]) -> float:
    xs = list(values)
    return sum(xs) / len(xs) if xs else math.nan


def repeatability(rows: list[dict], earlier: dict | None) -> None:
    """How far the measurement itself moves: a plan's median per round of this run against its median over the
    run, and (given an earlier report of the same plans) this run's measurement against that run's - the error a
    prediction would have if it were the earlier run's measurement of the very plan."""
    per_round = [abs(m / r["measured"] - 1) for r in rows for m in r.get("round_medians", [])]
    if per_round:
        mean = sum(per_round) / len(per_round)
        print(f"repeatability: a plan's median per round vs over the run, mean abs {mean:.0%}")
    if earlier is None:
        return
    then = {r["plan"]: r["measured"] for r in earlier["rows"]}
    pairs = [(then[r["plan"]], r) for r in rows if r["plan"] in then]
    if not pairs:
        return
    moved = sum(abs(t / r["measured"] - 1) for t, r in pairs) / len(pairs)
    predicted = sum(abs(r["predicted"] / r["measured"] - 1) for _, r in pairs) / len(pairs)
    rho = spearman([t for t, _ in pairs], [r["measured"] for _, r in pairs])
    print(
        f"repeatability: the earlier run's measurement as the prediction, mean abs error {moved:.0%}, "
        f"Spearman {rho:.2f} (this run's prediction on the same {len(pairs)} plans: {predicted:.0%})"
    )


if __name__ == "__main__":
    main()
