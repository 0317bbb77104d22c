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
import itertools
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
    out.mkdir(parents=True, exist_ok=True)
    plan = rl.schedule(args.seed, args.duration, args.interval)
    print(f"schedule (seed {args.seed}): " + ", ".join(f"{t:g} s {k} machine {m}" for t, k, m in plan), flush=True)
    (out / "schedule.json").write_text(json.dumps({"seed": args.seed, "plan": plan}))  # published before the run
    script = ["--timeout", str(args.timeout)] + (["--inplace"] if args.inplace else [])
    extra = [*in_place(args.inplace), *args.extra]
    loads = [os.getloadavg()[0]]
    measured: dict[str, dict[int, Any]] = {"rates": {}, "bare": {}}
    with netns.make(f"ch{os.getpid() % 1000}", 4, subnet=args.subnet) as machines:
        kinds = ([("bare", 0)] if args.bare and args.every else []) + [("rates", args.every)]
        # the normaliser at 6 processes last, right before the chaos job starts at 6 (and first again after it):
        # the VM's rate drifts with its other tenants, and the chaos job's first minute is compared with it
        for k, ((name, every), workers) in enumerate(itertools.product(kinds, ([0, 1], [0, 1, 2]))):
            world, folder = 2 * len(workers), out / f"{name}-{2 * len(workers)}"
            folder.mkdir(parents=True, exist_ok=True)
            alone = ch.GuideJob(machines, folder, [*script, "--every", str(every), "--start-world", str(world)],
                                port=29570 + k, extra=extra)  # fmt: skip
            measured[name][world] = ch.throughput(alone, 3, workers, args.measure)
            loads.append(os.getloadavg()[0])
            rate, quarters = measured[name][world]
            print(f"fault-free at {world} processes, snapshot={every}: {rate:.2f} steps/s (quarters "
                  f"{min(quarters):.2f}-{max(quarters):.2f}; load {loads[-1]:.1f})", flush=True)  # fmt: skip
        (out / "chaos").mkdir(parents=True, exist_ok=True)
        job = ch.GuideJob(machines, out / "chaos", [*script, "--every", str(args.every), "--start-world", "6",
                          "--keep-resumed"], port=29575, restarts=len(plan) + 5, extra=extra)  # fmt: skip
        faults, began, ended = ch.chaos(job, plan, args.duration, wake=args.inplace)
        loads.append(os.getloadavg()[0])
        for k, workers in enumerate(([0, 1, 2], [0, 1]) if args.again else ()):  # the normaliser, bracketed
            loads.append(os.getloadavg()[0])
            world, folder = 2 * len(workers), out / f"again-{2 * len(workers)}"
            folder.mkdir(parents=True, exist_ok=True)
            alone = ch.GuideJob(machines, folder, [*script, "--every", str(args.every), "--start-world", str(world)],
                                port=29580 + k, extra=extra)  # fmt: skip
            measured.setdefault("again", {})[world] = ch.throughput(alone, 3, workers, args.measure)
            print(f"fault-free again at {world} processes, snapshot={args.every}: "
                  f"{measured['again'][world][0]:.2f} steps/s", flush=True)  # fmt: skip
    return summarise(args, out / "chaos", faults, began, ended, measured, loads)


def summarise(args: argparse.Namespace, out: Path, faults: Any, began: float, ended: float,
              measured: dict[str, dict[int, Any]], loads: list[float]) -> dict[str, Any]:  # fmt: skip
    import chaos_harness as ch
    import chaos_ledger as cl
    import recovery_log as rl

    from .lineage import job_rows

    written, events, resumes = faults.rows(), faults.events, faults.job.rows("resumes.jsonl")
    rows, lost = job_rows(out)  # made whole: a row the first writer lost with its machine (lineage.py)
    nexts = [e.at for e in events[1:]] + [ended]
    costs = [
        {"event": e.__dict__, **rl.incident(rows, e, until, kept=args.inplace), "lines": faults.lines_per_machine(k)}
        for k, (e, until) in enumerate(zip(events, nexts, strict=True))
    ]
    spans = rl.timeline(events, began, ended, 6)
    rates = {w: r for w, (r, _) in measured["rates"].items()}
    bare = {w: r for w, (r, _) in measured["bare"].items()}
    result = {
        "rates": rates, "quarters": {w: q for w, (_, q) in measured["rates"].items()}, "events": costs,
        "goodput": rl.goodput(rows, spans, rates), "bare": bare,
        "bare_goodput": rl.goodput(rows, spans, bare) if bare else None,
        "ledger": cl.ledger(rows, resumes, events, spans, rates), "woken": faults.woke,
        "samples": rl.samples_check(rl.lineage(rows)), "stale_rows": rl.stale_rows(rows), "loads": loads,
        "replay": ch.replay(out, written, resumes, args.replay_steps), "out": str(out), "began": began,
        "lost": lost, "generations": by_generation(rows, [e.at for e in events], began, ended),
        "again": {w: r for w, (r, _) in measured.get("again", {}).items()},
        "silences": silences(out),
    }  # fmt: skip
    if result["again"]:  # the goodput against the mean of the rates measured before and after the chaos
        mean = {w: (r + result["again"].get(w, r)) / 2 for w, r in rates.items()}
        result["bracketed"] = {"rates": mean, "goodput": rl.goodput(rows, spans, mean)}
    first = result["generations"][0] if result["generations"] else None
    if first is not None and first["world"] in rates:  # the job's own fault-free stretch, before any event
        own = {**rates, first["world"]: first["rate"]}
        result["own"] = {"world": first["world"], "rate": first["rate"], "goodput": rl.goodput(rows, spans, own)}
    (out / "chaos.json").write_text(json.dumps(result, indent=1))
    return result


def silences(out: Path) -> dict[str, Any] | None:
    """The longest stand-still of a live member's stamps any worker read (``silences.jsonl``, steady_train.py),
    with the silence bound and each worker's longest: how near a live member came to being counted lost."""
    path = out / "silences.jsonl"
    if not path.exists():
        return None
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        return None
    longest: dict[int, float] = {}
    for r in rows:
        longest[r["id"]] = max(longest.get(r["id"], 0.0), float(r["s"]))
    top = max(rows, key=lambda r: float(r["s"]))
    return {"longest_s": float(top["s"]), "silence_s": float(top["silence_s"]), "at": top, "by_worker": longest}


def margin(found: dict[str, Any] | None) -> str | None:
    if not found:
        return None
    each, top, bound = sorted(found["by_worker"].values()), found["longest_s"], found["silence_s"]
    return (f"a live member's stamps read standing still at most {top:.2f} s (silence bound {bound:g} s: margin "
            f"{bound - top:.2f} s; read by worker {found['at']['id']} at step {found['at']['step']}); each "
            f"worker's longest: median {each[len(each) // 2]:.2f} s over {len(each)}")  # fmt: skip


def by_generation(rows: list[dict[str, Any]], events: list[float], began: float, ended: float,
                  settle: int = 20) -> list[dict[str, Any]]:  # fmt: skip
    """Each run's (a generation's) steady rate: its rows from the ``settle``-th on, up to the next event (the
    detection of a loss, a newcomer's boot and the first steps after a change left out), in steps per second.
    The first run, before any event, is the job's own fault-free stretch."""
    runs: dict[str, list[float]] = {}
    for r in sorted(rows, key=lambda r: r["time"]):
        runs.setdefault(r["run"], []).append(r["time"])
    out = []
    for run, times in runs.items():
        world = next(r["world"] for r in rows if r["run"] == run)
        if len(times) <= settle + 1:
            continue
        end = min([t for t in [*events, ended] if t > times[settle]], default=ended)
        kept = [t for t in times[settle:] if began <= t <= end]
        if len(kept) > 1 and kept[-1] > kept[0]:
            out.append({"run": run, "world": world, "from": kept[0] - began, "seconds": kept[-1] - kept[0],
                        "rate": (len(kept) - 1) / (kept[-1] - kept[0])})  # fmt: skip
    return out


def generations(result: dict[str, Any]) -> list[str]:
    """The steady rate of each generation against the fault-free rate at its size, and the job's own."""
    rates = {int(w): r for w, r in result["rates"].items()}
    gens = result.get("generations") or []
    parts = [f"{g['run']} {g['world']}p {g['rate']:.2f} ({100 * g['rate'] / rates[g['world']]:.0f} %)" for g in gens
             if g["world"] in rates]  # fmt: skip
    out = ["steady rate by generation (steps/s, % of fault-free at its size): " + ", ".join(parts)] if parts else []
    own = result.get("own")
    if own:
        out.append(f"the chaos job's own first minute (no event yet): {own['rate']:.2f} steps/s at {own['world']} "
                   f"processes, {100 * own['rate'] / rates[own['world']]:.0f} % of the separate fault-free job's; "
                   f"goodput against it {100 * own['goodput']['goodput']:.1f} %")  # fmt: skip
    if result.get("again"):
        out.append(
            "fault-free measured again after the chaos: "
            + ", ".join(
                f"{w} processes {r:.2f} steps/s (before {rates[int(w)]:.2f})"
                for w, r in sorted(result["again"].items())
            )
        )
    if result.get("bracketed"):
        out.append(f"goodput against the mean of the fault-free rates before and after the chaos "
                   f"{100 * result['bracketed']['goodput']['goodput']:.1f} %")  # fmt: skip
    return out


def report(result: dict[str, Any]) -> str:
    from .faults import lost_rows

    lines = ["| s | event | machine | world after | to first step s | paused s | redone | rolled back | lines "
             "| lost steps | most of it |", "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    t0 = result["began"]  # the schedule's clock
    for c, parts in zip(result["events"], result["ledger"]["by_event"], strict=True):
        e = c["event"]
        said = max(c["lines"].values(), default=0)
        lost = sum(v["lost"] for v in parts.values())
        top = sorted(parts.items(), key=lambda kv: -kv[1]["lost"])[:3]
        most = ", ".join(f"{k} {v['lost']:.1f}" for k, v in top if v["lost"] >= 0.5)
        head = f"| {e['at'] - t0:.0f} | {e['kind']} | {e['machine']} | {e['world']}"
        if not c["recovered"]:
            lines.append(f"{head} | not before the next event | | | | {said} | {lost:.1f} | {most} |")
            continue
        lines.append(f"{head} | {c['to_first_step_s']:.1f} | {c['pause_s']:.1f} | {c['redone']} "
                     f"| {c['rolled_back']} | {said} | {lost:.1f} | {most} |")  # fmt: skip
    g, s = result["goodput"], result["samples"]
    equal = sum(1 for r in result["replay"] if r["replayed"] and not r["differ"])
    steps = sum(r["steps"] for r in result["replay"])
    lines += ["", *breakdown(result), ""]
    lines += [
        f"goodput {100 * g['goodput']:.1f} % ({g['useful_steps']} steps of the final lineage against "
        f"{g['ideal_steps']:.0f} fault-free; " + ", ".join(f"{w} processes {r:.2f} steps/s" for w, r in
                                                           sorted(result["rates"].items())) + ")",
        *normalisation(result),
        *generations(result),
        f"replay: {equal} of {len(result['replay'])} runs equal bit for bit ({steps} steps compared); "
        f"lineage: {s['missing_steps']} steps missing, {s['skipped']} samples skipped, {s['twice']} seen twice; "
        f"{lost_rows(result.get('lost'))}rows from a superseded run: {result['stale_rows']}",
        woken(result["woken"]),
        margin(result.get("silences")),
        f"load (1 min) {min(result['loads']):.1f}-{max(result['loads']):.1f}; logs in {result['out']}",
    ]  # fmt: skip
    return "\n".join(x for x in lines if x is not None)


LABELS = ("redone", "detect", "newcomer start", "commit", "drop", "agree", "relayout", "recovery other",
          "replay save", "first step", "after a change", "recovery (restart)", "not absorbed", "steady")  # fmt: skip


def breakdown(result: dict[str, Any]) -> list[str]:
    """Where the goodput went (:mod:`chaos_ledger`): seconds, steps lost and points of goodput by label."""
    book = result["ledger"]
    ideal = book["ideal"]
    out = ["| where the time went | seconds | steps lost | goodput points |", "|---|---|---|---|"]
    for label in LABELS:
        if label in book["by_label"]:
            v = book["by_label"][label]
            out.append(f"| {label} | {v['seconds']:.1f} | {v['lost']:.1f} | {100 * v['lost'] / ideal:.1f} |")
    lost = ideal - book["useful"]
    out.append(f"| all | | {lost:.1f} | {100 * lost / ideal:.1f} |")
    return out


def normalisation(result: dict[str, Any]) -> list[str]:
    """How much the fault-free rates themselves move, and what the snapshots cost them."""
    out = ["fault-free rate by quarter of its measurement: " + ", ".join(
        f"{w} processes {min(q):.2f}-{max(q):.2f} steps/s ({100 * (max(q) - min(q)) / (2 * result['rates'][w]):.0f} %)"
        for w, q in sorted(result["quarters"].items()))]  # fmt: skip
    steady = result["ledger"]["by_label"].get("steady")
    if steady and steady["ideal"]:
        out.append(f"between events the job ran {100 * (1 - steady['lost'] / steady['ideal']):.1f} % of the "
                   "fault-free rate (the normalisation's error, with the after-change steps left out)")  # fmt: skip
    if result["bare"]:
        cost = ", ".join(f"{w} processes {100 * (result['bare'][w] / r - 1):+.1f} %" for w, r in
                         sorted(result["rates"].items()))  # fmt: skip
        out.append(f"snapshot=1 against no snapshots, fault-free: {cost}; goodput against jobs without snapshots "
                   f"{100 * result['bare_goodput']['goodput']:.1f} %")  # fmt: skip
    return out


def woken(found: list[dict[str, Any]]) -> str | None:
    """What each stopped or cut-off machine's old processes did once woken (in place: fenced, exit status 3)."""
    if not found:
        return None
    return "woken machines (old launcher's exit status, lines saying fenced): " + ", ".join(
        f"{w['kind']} {w['machine']}: {w['exit']}, {w['fenced_lines']}" for w in found
    )


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
    p.add_argument("--bare", action="store_true", help="also measure fault-free jobs without snapshots (their cost)")
    p.add_argument("--again", action="store_true", help="measure the fault-free rates again after the chaos")
    p.add_argument("--replay-steps", type=int, default=0, help="replay at most this many steps of each run (0: all)")
    p.add_argument("--subnet", type=int, default=62)
    p.add_argument("--keep", default=None, help="a folder for the jobs' logs and rows (default: a fresh temporary one)")
    p.add_argument(
        "--inplace",
        action="store_true",
        help="survivors keep their processes, a machine back joins: sw.runtime.InPlace, stagewise run --in-place",
    )
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more `stagewise run` flags (last)")
