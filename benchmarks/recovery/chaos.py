"""Ten minutes of chaos: a machine lost or taken back every minute on a seeded schedule, goodput and exactness.

The schedule (:func:`recovery_log.schedule`, printed first): every ``--interval`` seconds, a loss - SIGKILL,
SIGSTOP or the link down, of a machine drawn by the seed - when all three machines are up, else the machine
that is down comes back (started again with empty memory). First, fault-free jobs of 3 and of 2 machines
measure the steps per second at each size on this machine; then the chaos job (steady_train.py, the guide's
command, ``snapshot=--every``) runs the schedule. Printed: each event and what it cost, the goodput (steps of
the final lineage committed in the window, over what fault-free jobs of the sizes the schedule asked for
would have committed), and the replay: every run of the job (each process group, from its start or resume)
replayed by a fresh job of its size from the same step, float64 losses compared bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any


def run(args: argparse.Namespace) -> dict[str, Any]:
    import chaos_harness as ch
    import recovery_log as rl
    from helpers import netns

    from .faults import in_place

    out = Path(args.keep or tempfile.mkdtemp(prefix="chaos-"))
    plan = rl.schedule(args.seed, args.duration, args.interval)
    print(f"schedule (seed {args.seed}): " + ", ".join(f"{t:g} s {k} machine {m}" for t, k, m in plan), flush=True)
    script = ["--every", str(args.every), "--timeout", str(args.timeout)] + (["--inplace"] if args.inplace else [])
    extra = [*in_place(args.inplace), *args.extra]
    loads = [os.getloadavg()[0]]
    with netns.make(f"ch{os.getpid() % 1000}", 4, subnet=args.subnet) as machines:
        rates = {}
        for k, workers in enumerate(([0, 1, 2], [0, 1])):
            world = 2 * len(workers)
            alone = ch.GuideJob(machines, out / f"alone-{world}", [*script, "--start-world", str(world)],
                                port=29570 + k, extra=extra)  # fmt: skip
            (out / f"alone-{world}").mkdir(parents=True, exist_ok=True)
            rates[world] = ch.throughput(alone, 3, workers, args.measure)
            loads.append(os.getloadavg()[0])
            print(f"fault-free at {world} processes: {rates[world]:.2f} steps/s (load {loads[-1]:.1f})", flush=True)
        (out / "chaos").mkdir(parents=True, exist_ok=True)
        job = ch.GuideJob(machines, out / "chaos", [*script, "--start-world", "6", "--keep-resumed"], port=29575,
                          restarts=len(plan) + 5, extra=extra)  # fmt: skip
        faults, began, ended = ch.chaos(job, plan, args.duration)
        loads.append(os.getloadavg()[0])
    return summarise(args, out / "chaos", faults, began, ended, rates, loads)


def summarise(args: argparse.Namespace, out: Path, faults: Any, began: float, ended: float,
              rates: dict[int, float], loads: list[float]) -> dict[str, Any]:  # fmt: skip
    import chaos_harness as ch
    import recovery_log as rl

    rows, events = faults.rows(), faults.events
    nexts = [e.at for e in events[1:]] + [ended]
    costs = [
        {"event": e.__dict__, **rl.incident(rows, e, until), "lines": faults.lines_per_machine(k)}
        for k, (e, until) in enumerate(zip(events, nexts, strict=True))
    ]
    spans = rl.timeline(events, began, ended, 6)
    result = {
        "rates": rates, "events": costs, "goodput": rl.goodput(rows, spans, rates),
        "samples": rl.samples_check(rl.lineage(rows)), "stale_rows": rl.stale_rows(rows), "loads": loads,
        "replay": ch.replay(out, rows, faults.job.rows("resumes.jsonl"), args.replay_steps),
        "out": str(out), "began": began,
    }  # fmt: skip
    (out / "chaos.json").write_text(json.dumps(result, indent=1))
    return result


def report(result: dict[str, Any]) -> str:
    lines = ["| s | event | machine | world after | to first step s | paused s | redone | rolled back | lines |"]
    lines.append("|---|---|---|---|---|---|---|---|---|")
    t0 = result["began"]  # the schedule's clock
    for c in result["events"]:
        e = c["event"]
        said = max(c["lines"].values(), default=0)
        if not c["recovered"]:
            head = f"| {e['at'] - t0:.0f} | {e['kind']} | {e['machine']} | {e['world']}"
            lines.append(f"{head} | not before the next event | | | | {said} |")
            continue
        lines.append(
            f"| {e['at'] - t0:.0f} | {e['kind']} | {e['machine']} | {e['world']} | {c['to_first_step_s']:.1f} "
            f"| {c['pause_s']:.1f} | {c['redone']} | {c['rolled_back']} | {said} |"
        )
    g, s = result["goodput"], result["samples"]
    equal = sum(1 for r in result["replay"] if r["replayed"] and not r["differ"])
    steps = sum(r["steps"] for r in result["replay"])
    lines += [
        "",
        f"goodput {100 * g['goodput']:.1f} % ({g['useful_steps']} steps of the final lineage against "
        f"{g['ideal_steps']:.0f} fault-free; " + ", ".join(f"{w} processes {r:.2f} steps/s" for w, r in
                                                           sorted(result["rates"].items())) + ")",
        f"replay: {equal} of {len(result['replay'])} runs equal bit for bit ({steps} steps compared); "
        f"lineage: {s['missing_steps']} steps missing, {s['skipped']} samples skipped, {s['twice']} seen twice; "
        f"rows from a superseded run: {result['stale_rows']}",
        f"load (1 min) {min(result['loads']):.1f}-{max(result['loads']):.1f}; logs in {result['out']}",
    ]  # fmt: skip
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    result = run(args)
    print(report(result))
    bad = [r for r in result["replay"] if not r["replayed"] or r["differ"]]
    return 1 if bad else 0


def add(sub: Any) -> None:
    p = sub.add_parser("chaos", help="a loss or a return every minute on a seeded schedule (root: ip netns)")
    p.add_argument("--duration", type=float, default=600.0, help="seconds of chaos")
    p.add_argument("--interval", type=float, default=60.0, help="seconds between events")
    p.add_argument("--seed", type=int, default=43, help="43: every kind of loss, every machine")
    p.add_argument("--every", type=int, default=1, help="snapshot= of the job")
    p.add_argument("--timeout", type=float, default=10.0, help="the pipeline's hang threshold, seconds")
    p.add_argument("--measure", type=float, default=40.0, help="seconds of each fault-free throughput measurement")
    p.add_argument("--replay-steps", type=int, default=0, help="replay at most this many steps of each run (0: all)")
    p.add_argument("--subnet", type=int, default=62)
    p.add_argument("--keep", default=None, help="a folder for the jobs' logs and rows (default: a fresh temporary one)")
    p.add_argument(
        "--inplace",
        action="store_true",
        help="survivors keep their processes, a machine back joins: sw.runtime.InPlace, stagewise run --in-place",
    )
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more `stagewise run` flags (last)")
