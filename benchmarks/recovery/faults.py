"""A machine lost (SIGKILL, SIGSTOP, its link down) and taken back, many times in one job: what each costs.

One job of steady_train.py on 3 namespace machines of 2 processes (the guide's command, the store apart on a
fourth machine); for each trial and case, a machine is lost, the survivors' first committed step awaited
(and ``--settle`` more), then the machine is started again and the first step at full size awaited. The
victim turns over the three machines. Per case, over the trials: seconds from the fault to the survivors'
first committed step, steps redone, committed steps rolled back, samples skipped or seen twice, lines each
survivor printed; and for the returns, how long the others paused.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def run(args: argparse.Namespace) -> dict[str, Any]:
    from helpers import netns

    out = Path(args.keep or tempfile.mkdtemp(prefix="recovery-"))
    loads, failed = [os.getloadavg()[0]], ""
    began = time.time()
    each = [[c] for _ in range(args.trials) for c in args.cases]  # a fresh job per trial
    jobs = [list(args.cases) * args.trials] if args.returns else each
    with netns.make(f"rb{os.getpid() % 1000}", 4, subnet=args.subnet) as machines:
        for k, cases in enumerate(jobs):
            try:
                one_job(args, machines, out / f"job-{k}", cases, loads)
            except BaseException as err:  # (pytest's Failed too) what was measured before it still counts
                failed = f"job-{k} failed: {str(err).splitlines()[0] if str(err) else type(err).__name__}"
                break
    return {**analyse(out, kept=args.inplace), "loads": loads, "wall_s": time.time() - began, "failed": failed}


def analyse(out: Path, kept: bool = False) -> dict[str, Any]:
    """Every job's events (events.jsonl) against its rows (steps.jsonl), under ``out/job-*``; ``kept``: in place
    (a return, taken in between steps, throws no step away: :func:`recovery_log.incident`)."""
    import recovery_log as rl

    from .lineage import job_rows

    found, stale, steps = [], 0, 0
    samples = {"missing_steps": 0, "skipped": 0, "twice": 0}
    lost: dict[str, list[int]] = {"second": [], "resume": []}  # rows the first writer lost, and who holds them
    for folder in sorted(out.glob("job-*"), key=lambda p: int(p.name.split("-")[1])):
        rows, filled = job_rows(folder)  # made whole: a row the first writer lost (lineage.py)
        lost = {k: lost[k] + filled[k] for k in lost}
        events = [json.loads(x) for x in (folder / "events.jsonl").read_text().splitlines()]
        logs = {int(i): (folder / f"machine{i}.log").read_bytes().count(b"\n") for i in events[0]["lines"]}
        resumes = [json.loads(x) for x in _text(folder / "resumes.jsonl").splitlines()]
        for k, e in enumerate(events):
            event = rl.Event(e["kind"], e["machine"], e["at"], e["world"])
            after = {int(i): n for i, n in events[k + 1]["lines"].items()} if k + 1 < len(events) else logs
            lines = {int(i): after[int(i)] - n for i, n in e["lines"].items() if int(i) != event.machine}
            cost = rl.incident(rows, event, kept=kept)
            found.append({"event": event.__dict__, **cost, **breakdown(resumes, event, cost), "lines": lines})
        line = rl.lineage(rows)
        samples = {key: samples[key] + n for key, n in rl.samples_check(line).items()}
        stale, steps = stale + rl.stale_rows(rows), steps + len(line)
    (out / "incidents.json").write_text(json.dumps(found, indent=1))
    return {"incidents": found, "samples": samples, "stale_rows": stale, "out": str(out), "steps": steps, "lost": lost}


def _text(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def breakdown(resumes: list[dict[str, Any]], event: Any, cost: dict[str, Any]) -> dict[str, Any]:
    """In place, where an incident's seconds went, as the new generation's first member saw them (its resume
    row: when its state was back, how long its recovery took, the parts): ``detect`` from the fault to the
    failure seen there, ``recover`` (drop + agreement + group + build + resume), ``step`` the rest."""
    row = next((r for r in resumes if "seconds" in r and r["time"] >= event.at), None)
    if row is None or not cost.get("recovered"):
        return {}
    detect = row["time"] - row["seconds"] - event.at
    step = cost["to_first_step_s"] - detect - row["seconds"]
    return {"detect_s": detect, "recover_s": row["seconds"], "step_s": step, "parts": row.get("parts", {})}


def one_job(args: argparse.Namespace, machines: Any, out: Path, cases: list[str], loads: list[float]) -> Any:
    """A job that meets each fault of ``cases`` in turn (and, with ``--returns``, gets the machine back after
    each); every machine stopped at the end."""
    from chaos_harness import start, stop_all

    job = guide_job(machines, out, args.every, args.timeout, args.inplace, port=29560 + len(loads) % 30,
                    restarts=4 * len(cases) + 5, extra=args.extra)  # fmt: skip
    faults = start(job, 3, [0, 1, 2])
    for case in cases:
        victim = len(loads) % 3  # turns over the machines
        lost = faults.lose(case, victim)
        faults.absorbed(lost, args.wait, more=args.settle)
        if args.returns:
            faults.absorbed(faults.back(victim), args.wait, more=args.settle)
        loads.append(os.getloadavg()[0])
        print(f"{case} of machine {victim}: done, load {loads[-1]:.1f}", flush=True)
    faults.lines_at.append(faults.log_lines())
    stop_all(machines)
    return faults


def guide_job(machines: Any, out: Path, every: int, timeout: float, inplace: bool, port: int, restarts: int,
              script: Sequence[str] = (), extra: Sequence[str] = ()) -> Any:  # fmt: skip
    """steady_train.py at 6 processes on 3 namespace machines (the store on the fourth) under the guide's command,
    ``snapshot=every``, hang threshold ``timeout``; ``inplace``: :func:`in_place`. Not started yet."""
    from chaos_harness import GuideJob

    out.mkdir(parents=True, exist_ok=True)
    flags = ["--every", str(every), "--timeout", str(timeout), "--start-world", "6", *script]
    flags += ["--inplace"] if inplace else []
    return GuideJob(machines, out, flags, port=port, restarts=restarts, extra=[*in_place(inplace), *extra])


def in_place(inplace: bool) -> list[str]:
    """``stagewise run`` flags of the in-place path: the first round waits for all three machines (MAX closes it
    at once), so that the job starts at full size; a machine taken back later joins the running job."""
    return ["--in-place", "--rdzv-conf", "last_call_timeout=60"] if inplace else []


def table(result: dict[str, Any], cases: list[str]) -> str:
    import recovery_log as rl

    head = "| case | trials | to first step p50 / p95 / max s | others paused p50 / p95 / max s "
    head += "| redone (max) | rolled back (max) | skipped / twice | lines per survivor (max) "
    head += "| detect / recover / step p50 s |"
    lines = [head, "|---|---|---|---|---|---|---|---|---|"]
    returns = any(i["event"]["kind"] == "back" for i in result["incidents"])
    for case in [*cases, "back"] if returns else cases:
        got = [i for i in result["incidents"] if i["event"]["kind"] == case]
        ok = [i for i in got if i["recovered"]]
        first = rl.percentiles([i["to_first_step_s"] for i in ok])
        pause = rl.percentiles([i["pause_s"] for i in ok])
        said = max((n for i in ok for n in i["lines"].values()), default=0)
        lines.append(
            f"| {case} | {len(ok)} of {len(got)} | {spread(first)} | {spread(pause)} | {worst(ok, 'redone')} "
            f"| {worst(ok, 'rolled_back')} | {sum(i['skipped'] for i in ok)} / {sum(i['twice'] for i in ok)} "
            f"| {said} | {parts(ok)} |"
        )
    s = result["samples"]
    lines.append("")
    lines.append(
        f"final lineage: {result['steps']} steps, {s['missing_steps']} missing, {s['skipped']} samples skipped, "
        f"{s['twice']} seen twice; {lost_rows(result.get('lost'))}rows from a superseded run: {result['stale_rows']}; "
        f"load (1 min) {min(result['loads']):.1f}-{max(result['loads']):.1f}; {result['wall_s']:.0f} s; "
        f"logs in {result['out']}" + (f"; cut short: {result['failed']}" if result["failed"] else "")
    )
    return "\n".join(lines)


def lost_rows(lost: dict[str, list[int]] | None) -> str:
    """The steps whose row the first writer lost (its machine killed after the step), and who recorded them."""
    if not lost:
        return ""
    said = [f"{len(v)} by {k} {v}" for k, v in lost.items() if v]
    return f"rows the first writer lost: {', '.join(said) if said else 0}; "


def parts(found: list[dict[str, Any]]) -> str:
    """p50 of each part of the in-place incidents ("-" on the restart path, which keeps no breakdown)."""
    import statistics

    got = [i for i in found if "detect_s" in i]
    if not got:
        return "-"
    return " / ".join(f"{statistics.median(i[k] for i in got):.2f}" for k in ("detect_s", "recover_s", "step_s"))


def spread(p: dict[str, float]) -> str:
    return f"{p['p50']:.1f} / {p['p95']:.1f} / {p['max']:.1f}"


def worst(found: list[dict[str, Any]], key: str) -> int:
    return max((i[key] for i in found), default=0)


def add(sub: Any) -> None:
    p = sub.add_parser("faults", help="kill, stop, partition and return, --trials times each (root: ip netns)")
    p.add_argument("--trials", type=int, default=20, help="per case (the issue asks 20)")
    p.add_argument("--cases", nargs="+", default=["kill", "partition", "stop"], choices=["kill", "partition", "stop"])
    p.add_argument("--every", type=int, default=1, help="snapshot= of the job (0: none)")
    p.add_argument("--timeout", type=float, default=10.0, help="the pipeline's hang threshold, seconds")
    p.add_argument("--settle", type=int, default=5, help="steps committed after each recovery before the next fault")
    p.add_argument("--wait", type=float, default=300.0, help="give up on a recovery after this many seconds")
    p.add_argument("--subnet", type=int, default=61)
    p.add_argument("--keep", default=None, help="a folder for the job's logs and rows (default: a fresh temporary one)")
    p.add_argument(
        "--no-returns",
        dest="returns",
        action="store_false",
        help="a fresh job per trial, no machine taken back (a path that cannot take one back)",
    )
    p.add_argument(
        "--inplace",
        action="store_true",
        help="the survivors keep their processes: sw.runtime.InPlace under `stagewise run --in-place`",
    )
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more `stagewise run` flags (last)")
