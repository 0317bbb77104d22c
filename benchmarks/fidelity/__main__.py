"""The simulator against the runtime: every synchronous schedule simulated and measured (issue 39, items 4 and 5).

    .venv/bin/python -m benchmarks.fidelity                  # 3 workloads x {2, 4} ranks x every schedule + auto
    .venv/bin/python -m benchmarks.fidelity --pays           # GPT d 256, 2 ranks, m 8: 1f1b, zb-h1, zb-v, auto
    .venv/bin/python -m benchmarks.fidelity --quick          # a smoke run: few steps, m 4
    PYTHONPATH=/path/to/old/src .venv/bin/python -m benchmarks.fidelity ...   # the same on older code

One torchrun job per (workload, rank count), every schedule inside it (:mod:`.worker`: profile, calibrate,
the schedules' timed steps taking turns round by round, a metered twin of each for the activation peak, the
predictions on the cut each pipeline ran). One thread per rank; 4 ranks on fewer cores are marked
oversubscribed, and the 10 % goal is judged at 2 ranks only.

Per schedule: the simulated step (the profile's costs and the calibrated link) against the measured one (the
median over the timed steps of the slowest rank's ``train_step`` from a barrier) and the simulated activation
peak against the meter's (``measure_memory=True``), with their errors; the ranking check (the order by measured
time must equal the order by simulated time for every pair more than 5 % apart by simulation); and what names
a miss: the planner's prediction (the runtime's calibrated costs per action and step, the compute scaled by
``measure_compute_scale``'s factors on the group, and shared cores), the
prediction at the compute measured inside the pipeline, the busiest rank's compute against the profile's,
its messages and the time per message, its gaps and the step's head and tail. Per stage: (I + W) / B and the
share of the forward's saved bytes that W holds, from the profile and measured.

``--pays`` adds the ratios to 1F1B and issue 39's targets, and draws the measured and simulated timelines of
each schedule on one time axis (``--out``). Everything goes to ``--out``: ``fidelity.json`` (or ``pays.json``:
the raw jobs, their rows, the run's conditions), the same tables as ``.md``, and the workers' logs.
``--from FILE`` renders a saved JSON again.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .._launch import environ, torchrun
from .report import pays_checks, summarize
from .tables import checks_table, job_section, pays_table

WORKLOADS = ("gpt64", "gpt256", "resnet")
PAYS = ("1f1b", "zb-h1", "zb-v", "auto")


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def code() -> dict[str, Any]:
    """Which stagewise runs (the ranks import the same: PYTHONPATH goes to them), its commit, torch's version."""
    import stagewise

    where = Path(stagewise.__file__).resolve().parent

    def git(*words: str) -> str:
        return subprocess.run(["git", "-C", str(where), *words], capture_output=True, text=True).stdout.strip()

    return {"stagewise": str(where), "commit": git("rev-parse", "--short", "HEAD"),
            "dirty": bool(git("status", "--porcelain", "--", ".")), "version": stagewise.__version__}  # fmt: skip


def schedules(args: argparse.Namespace) -> list[str]:
    if args.schedules:
        return list(args.schedules)
    if args.pays:
        return list(PAYS)
    import stagewise as sw

    return [*sw.schedule_names(synchronous=True), "auto"]


def job(workload: str, ranks: int, names: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """One torchrun job: the worker's JSON (its log beside it in ``--out``)."""
    result = args.out / f"{workload}-{ranks}.json"
    flags = [
        f"--workload={workload}", f"--schedules={','.join(names)}", f"--microbatches={args.microbatches}",
        f"--steps={args.steps}", f"--rounds={args.rounds}", f"--warmup={args.warmup}", f"--repeats={args.repeats}",
        f"--profile-rounds={args.profile_rounds}", f"--passes={args.passes}", f"--partition={args.partition}",
        f"--scale-steps={args.scale_steps}", f"--out={result}",
    ]  # fmt: skip
    if args.pays:
        flags.append("--timelines")
    cmd = torchrun(ranks, "benchmarks.fidelity.worker", flags, options=["--max-restarts=0"])
    log = args.out / f"{workload}-{ranks}.log"
    print(f"{workload} at {ranks} ranks: running (progress in {log})", file=sys.stderr, flush=True)
    started = time.perf_counter()
    with log.open("w") as sink:
        done = subprocess.run(cmd, stdout=sink, stderr=subprocess.STDOUT, env=environ(OMP_NUM_THREADS="1"),
                              timeout=args.job_timeout)  # fmt: skip
    if done.returncode or not result.exists():
        raise SystemExit(f"{workload} at {ranks} ranks failed (exit {done.returncode}); its log: {log}")
    out = json.loads(result.read_text())
    result.unlink()
    print(f"{workload} at {ranks} ranks: {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return dict(out)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Every job, and the conditions it ran under."""
    names = schedules(args)
    workloads = ["gpt256"] if args.pays else args.workloads
    ranks = [2] if args.pays else args.ranks
    load = os.getloadavg()[0]
    started = time.perf_counter()
    jobs = [job(w, r, names, args) for w in workloads for r in ranks]
    return {
        "date": datetime.datetime.now().isoformat(timespec="minutes"),
        "command": " ".join(["python -m benchmarks.fidelity", *sys.argv[1:]]),
        "smoke": args.quick,
        "machine": f"{platform.processor() or platform.machine()}, {cores()} cores",
        "cores": cores(),
        "load": [load, os.getloadavg()[0]],
        "seconds": time.perf_counter() - started,
        "code": code(),
        "pays": args.pays,
        "jobs": jobs,
    }


def markdown(everything: dict[str, Any]) -> str:
    """The tables of every job (and for ``--pays`` the ratios, the targets and the pictures' names)."""
    c = everything["code"]
    smoke = "**SMOKE RUN** (tiny sizes, a loaded machine: no conclusion from these numbers). " * everything["smoke"]
    lines = [
        f"## {everything['date']}: `{everything['command']}`",
        f"{smoke}{everything['machine']}; load average {everything['load'][0]:.2f} before, "
        f"{everything['load'][1]:.2f} after; {everything['seconds']:.0f} s; stagewise {c['version']} at "
        f"{c['commit']}{' (modified)' if c['dirty'] else ''} ({c['stagewise']}).",
    ]
    for j in everything["jobs"]:
        rows = j["rows"] = summarize(j)
        lines.append(job_section(j, rows, oversubscribed=j["ranks"] > everything["cores"]))
        if everything["pays"]:
            lines += [pays_table(rows), checks_table(pays_checks(j, rows))]
    for path in everything.get("pictures", []):
        lines.append(f"![measured over simulated timelines]({Path(path).name})")
    return "\n\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    p.add_argument("--ranks", nargs="+", type=int, default=[2, 4])
    p.add_argument("--schedules", nargs="+", default=None, help="default: every synchronous schedule and auto")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--steps", type=int, default=16, help="timed steps per schedule")
    p.add_argument("--rounds", type=int, default=4, help="the schedules take turns this many times")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per schedule before its first round")
    p.add_argument("--repeats", type=int, default=7, help="the profile's repeats per layer")
    p.add_argument("--profile-rounds", type=int, default=3, help="the profile's rounds (each layer's fastest)")
    p.add_argument("--passes", type=int, default=3, help="sw.calibrate()'s passes")
    p.add_argument("--scale-steps", type=int, default=6, help="measure_compute_scale's steps per pass (0: skip)")
    p.add_argument("--partition", default="uniform", help="the hand-written schedules' cut (auto times its own)")
    p.add_argument("--pays", action="store_true", help="issue 39's 'it pays': GPT d 256, 2 ranks, m 8, pictures")
    p.add_argument("--quick", action="store_true", help="a smoke run: m 4, 2 timed steps, short profile")
    p.add_argument("--out", type=Path, default=Path("out/fidelity"), help="JSON, markdown, logs, pictures")
    p.add_argument("--from", dest="saved", type=Path, default=None, help="render a saved JSON, measure nothing")
    p.add_argument("--job-timeout", type=float, default=3600.0, help="seconds one torchrun job may take")
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if args.quick:
        args.microbatches, args.steps, args.rounds, args.warmup = 4, 2, 2, 1
        args.repeats, args.profile_rounds, args.passes = 2, 1, 1
    args.out.mkdir(parents=True, exist_ok=True)
    everything = json.loads(args.saved.read_text()) if args.saved is not None else measure(args)
    stem = "pays" if everything["pays"] else "fidelity"
    if everything["pays"]:
        from .pictures import draw

        everything["pictures"] = [str(p) for p in draw(everything["jobs"], args.out)]
    text = markdown(everything)
    (args.out / f"{stem}.md").write_text(text)
    (args.out / f"{stem}.json").write_text(json.dumps(everything))
    print(text)


if __name__ == "__main__":
    main()
