"""Held-out calibration (issue 49 item 2): calibrate on the runs of plan P, predict plans Q != P.

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.calibration --out out/calibration          # 2 and 4 ranks
    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.calibration --quick --out out/calibration  # smoke run
    sudo OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.calibration --netem --quick --out out/calibration  # + latency

One torchrun job per world size (:mod:`.worker`); the plan space and the seed are :mod:`.space`'s, committed
before the first full run. Every Q is built ``--rounds`` times, interleaved (the Qs; the Qs reversed; ...), so
that each plan's between-build spread is measured and a drift of the machine falls on all; P is built and
calibrated again before every ``--p-every`` Qs (its level sets every prediction's: read across the whole sweep).
Per job: each Q's predicted step and interval (from P's runs only) against its measured level (the geometric
mean of its builds' medians); the mean absolute error, Kendall's tau (pairs of the same m and pp whose medians
differ by more than twice the pooled spread of their steps; and over the pairs twice their builds' standard
error apart), the share of measured steps inside the interval and its median half-width over the step spread
(:mod:`.report`); beside them the measurement's own noise (:mod:`.noise`): the between- and within-build sd,
the MAE a perfect model would show (the floor), and the coverage of a perfect interval at twice the spread.
The row ``after, 1 build`` is what a benchmark of one build per plan would have said (round 0 alone).
``--netem``: each world size's job runs across two namespace machines, once per link of :data:`.netem.LINKS`
(``tc netem`` latency, or :mod:`.delay_line` where the kernel lacks netem; ``tc tbf`` bandwidth; root), ``--links``
a subset of them; with ``--pin`` each machine on a core of its own. Writes ``calibration.json`` and
``calibration.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from .._launch import environ, torchrun
from . import builds, peaks
from .netem import LINKS, job
from .report import one_build_summary, summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("out/calibration"))
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--workload", default="gpt256", help="a workload of benchmarks.fidelity")
    parser.add_argument("--plans", type=int, default=32, help="plans Q per world size (the space's first N)")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per build")
    parser.add_argument("--rounds", type=int, default=3, help="builds of every Q, interleaved")
    parser.add_argument("--p-every", type=int, default=8, help="P built and calibrated again before every N Qs")
    parser.add_argument("--pin", action="store_true",
                        help="each rank on its own core (stagewise run --pin-cores), in the jobs whose ranks do not "
                        "outnumber the cores")  # fmt: skip
    parser.add_argument("--builds", action="store_true",
                        help="instead: P built --rounds times per condition of builds.CONDITIONS (why builds "
                        "differ)")  # fmt: skip
    parser.add_argument("--peaks", action="store_true",
                        help="instead: every Q built once with the activation meter, its peak against the "
                        "prediction (peaks.py; bytes: no quiet machine needed)")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="2 ranks, gpt64, 4 plans, 2 steps, 2 rounds")
    parser.add_argument("--netem", action="store_true",
                        help="across 2 namespace machines, once per link of netem.LINKS (root)")  # fmt: skip
    parser.add_argument("--links", nargs="+", metavar="LINK",
                        help="with --netem, only these links of netem.LINKS ('' the unshaped veth)")  # fmt: skip
    parser.add_argument("--mtu", type=int, help="with --netem, every veth's MTU (a delay line's is netem.DELAY_MTU)")
    args = parser.parse_args(argv)
    if args.links is not None and not set(args.links) <= set(LINKS):
        parser.error(f"--links: {sorted(set(args.links) - set(LINKS))} not in netem.LINKS {list(LINKS)}")
    if args.quick:
        args.ranks, args.workload, args.plans, args.steps, args.rounds = [2], "gpt64", 4, 2, 2
    args.out.mkdir(parents=True, exist_ok=True)
    if args.builds:
        return builds_only(args)
    if args.peaks:
        return peaks_only(args)
    results, rows = [], []
    links = [link for link in LINKS if args.links is None or link in args.links] if args.netem else [None]
    jobs = [(world, link) for world in args.ranks for link in links]
    for k, (world, link) in enumerate(jobs):
        worker = ["--workload", args.workload, "--plans", str(args.plans), "--steps", str(args.steps),
                  "--rounds", str(args.rounds), "--p-every", str(args.p_every),
                  *(["--pin"] if pinned(args, world) else [])]  # fmt: skip
        if link is None:
            path = args.out / f"job-{args.workload}-{world}.json"
            done = subprocess.run(torchrun(world, "benchmarks.calibration.worker", [*worker, "--out", str(path)]),
                                  env=environ(OMP_NUM_THREADS="1"))  # fmt: skip
            result = json.loads(path.read_text()) if done.returncode == 0 else None
        else:
            path = args.out / f"job-{args.workload}-{world}-link{k}.json"
            result = job(link, world, worker, path, port=29611 + k, mtu=args.mtu)
        if result is None:
            print(f"job at {world} ranks (link {link!r}) failed or skipped", file=sys.stderr)
            continue
        results.append(result)
        where = "one machine" if link is None else result["link"]
        for model in ("after", "at batch", "before"):
            rows.append({**summary(result, model), "link": where})
        if result.get("rounds", 1) > 1:
            rows.append({**one_build_summary(result), "link": where})
    (args.out / "calibration.json").write_text(json.dumps({"jobs": results, "summary": rows, "load": os.getloadavg()}))
    lines = table(rows)
    (args.out / "calibration.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if len(results) == len(jobs) or (args.netem and results) else 1


def peaks_only(args: argparse.Namespace) -> int:
    """``--peaks``: per world size, :mod:`.peaks`'s job (every Q built once with the meter); one table."""
    results = []
    for world in args.ranks:
        path = args.out / f"peaks-{args.workload}-{world}.json"
        worker = ["--peaks", "--workload", args.workload, "--plans", str(args.plans), "--out", str(path)]
        done = subprocess.run(
            torchrun(world, "benchmarks.calibration.worker", worker), env=environ(OMP_NUM_THREADS="1")
        )
        if done.returncode:
            return done.returncode
        results.append(json.loads(path.read_text()))
    lines = peaks.table(results)
    (args.out / "peaks.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def pinned(args: argparse.Namespace, world: int) -> bool:
    """``--pin`` for a job of ``world`` ranks: only where each rank can have a core of its own (else said)."""
    if args.pin and world > len(os.sched_getaffinity(0)):
        print(f"--pin: {world} ranks on {len(os.sched_getaffinity(0))} cores run unpinned (sharing)", file=sys.stderr)
    return bool(args.pin) and world <= len(os.sched_getaffinity(0))


def builds_only(args: argparse.Namespace) -> int:
    """``--builds``: per world size, :mod:`.builds`'s job; its table."""
    for world in args.ranks:
        path = args.out / f"builds-{args.workload}-{world}.json"
        worker = ["--builds", "--workload", args.workload, "--steps", str(args.steps), "--rounds", str(args.rounds)]
        done = subprocess.run(torchrun(world, "benchmarks.calibration.worker", [*worker, "--out", str(path)]),
                              env=environ(OMP_NUM_THREADS="1"))  # fmt: skip
        if done.returncode:
            return done.returncode
        lines = [f"{args.workload}, {world} processes:", *builds.table(json.loads(path.read_text()))]
        (args.out / f"builds-{args.workload}-{world}.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
    return 0


def table(rows: list[dict]) -> list[str]:
    """The markdown table: per job and model the figures against the goals, the noise beside them."""
    lines = ["| workload | ranks | link | model | plans x builds | MAE | floor | max | tau (pairs) | tau, builds apart "
             "| inside | oracle inside | half-width / spread | between / within sd | drift by round |",
             "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    for r in rows:
        lines.append(
            f"| {r['workload']} | {r['world']} | {r['link']} | {r['model']} | {r['plans']} x {r['builds']:g} "
            f"| {r['mean abs error']:.1%} | {r['floor mae']:.1%} | {r['max abs error']:.1%} "
            f"| {r['kendall tau']:.2f} ({r['pairs']}) | {r['kendall tau (builds)']:.2f} ({r['pairs (builds)']}) "
            f"| {r['inside interval']:.0%} | {r['oracle inside']:.0%} | {r['median half-width / spread']:.1f} "
            f"| {r['between sd']:.1%} / {r['within sd']:.1%} "
            f"| {' '.join(f'{x:+.1%}' for x in r.get('round drift') or []) or '-'} |"
        )
    return lines


if __name__ == "__main__":
    sys.exit(main())
