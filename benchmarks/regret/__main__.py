"""Planner regret (issue 49 item 5): at 4 processes, on three workloads, the plan the calibrated planner picks
against the best plan of a sweep of at least 30, both measured again with their spread.

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.regret --out out/regret            # 3 workloads, 33 plans
    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.regret --quick --out out/regret    # smoke run

The sweep is the held-out calibration benchmark's space (:mod:`benchmarks.calibration.space`, committed before
its first run): the calibrating plan P and 32 plans Q at 4 processes (pp 4, or pp 2 x dp 2; five schedules;
4 or 8 micro-batches; four cuts). The planner picks the plan of least predicted step, its costs calibrated on
P's run (:class:`~stagewise.runtime.RunCalibrator`) and nothing of Q measured before its prediction. Then the
pick and the sweep's best (least measured median) are built again and timed alternately, ``--again`` rounds:
the regret is the pick's median over the best's, minus one (goal: within 5 %). One torchrun job per workload
(:mod:`.worker`). Writes ``regret.json`` and ``regret.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from .._launch import environ, torchrun
from .report import regret, table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("out/regret"))
    parser.add_argument("--workloads", nargs="+", default=["gpt64", "resnet", "gpt256"])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--plans", type=int, default=32, help="plans Q besides P (the space's first N)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per plan in the sweep")
    parser.add_argument("--again", type=int, default=8, help="rounds of the pick and the best measured again")
    parser.add_argument("--quick", action="store_true", help="gpt64 only, 3 plans, 2 steps, 3 rounds")
    args = parser.parse_args(argv)
    if args.quick:
        args.workloads, args.plans, args.steps, args.again = ["gpt64"], 3, 2, 3
    args.out.mkdir(parents=True, exist_ok=True)
    results, load = [], [os.getloadavg()]
    for name in args.workloads:
        path = args.out / f"job-{name}.json"
        cmd = torchrun(args.ranks, "benchmarks.regret.worker", [
            "--workload", name, "--plans", str(args.plans), "--steps", str(args.steps),
            "--again", str(args.again), "--out", str(path),
        ])  # fmt: skip
        done = subprocess.run(cmd, env=environ(OMP_NUM_THREADS="1"))
        load.append(os.getloadavg())
        if done.returncode != 0:
            print(f"{name} failed ({done.returncode})", file=sys.stderr)
            continue
        result = json.loads(path.read_text())
        result["regret"] = regret(result["again"])
        if "pick before" in result["again"]:
            result["regret before"] = regret({"pick": result["again"]["pick before"], "best": result["again"]["best"]})
        results.append(result)
    lines = table(results)
    (args.out / "regret.json").write_text(json.dumps({"jobs": results, "load": load}))
    (args.out / "regret.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print("load averages (1, 5, 15 min) before and after each job:", [tuple(round(v, 1) for v in x) for x in load])
    return 0 if len(results) == len(args.workloads) else 1


if __name__ == "__main__":
    sys.exit(main())
