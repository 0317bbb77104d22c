"""What a cut-off (or stopped) machine's processes cost the survivors when every machine shares one VM's cores.

In the chaos run the machines are network namespaces on one VM: a machine whose link is down keeps its
processes on the same cores as the survivors (on a real cluster they would burn their own CPUs). This
measures it: a fault-free stretch, then one loss, then the machine back; every second, each machine's CPU
use (the sum of ``/proc/<pid>/stat`` utime + stime over its namespace's processes) and the job's steps. The
printed table says, per phase, each machine's cores in use and the job's steps per second.

    sudo .venv/bin/python -m benchmarks.recovery cutoff --kind partition --keep /tmp/cutoff
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: list[str]) -> float:
    """CPU seconds (user + system) used so far by ``pids`` (the ones that ended meanwhile count nothing)."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return total / _TICK


def phases(samples: list[dict[str, Any]], marks: dict[str, float]) -> list[dict[str, Any]]:
    """Per phase (between two marks): each machine's cores in use and the job's steps per second."""
    names = sorted(marks, key=marks.get)  # type: ignore[arg-type]
    out = []
    for name, nxt in zip(names, [*names[1:], None], strict=True):
        inside = [s for s in samples if s["t"] >= marks[name] and (nxt is None or s["t"] < marks[nxt])]
        if len(inside) < 2:
            continue
        span = inside[-1]["t"] - inside[0]["t"]
        cores = {m: (inside[-1]["cpu"][m] - inside[0]["cpu"][m]) / span for m in inside[0]["cpu"]}
        steps = inside[-1]["steps"] - inside[0]["steps"]
        per_step = {  # each process alive at both ends: its CPU milliseconds per step of the job
            f"{inside[0].get('where', {}).get(pid, '?')} {pid}": 1000 * (inside[-1]["pids"][pid] - cpu) / max(steps, 1)
            for pid, cpu in inside[0]["pids"].items() if pid in inside[-1]["pids"]
        }  # fmt: skip
        out.append({"phase": name, "seconds": span, "cores": cores, "steps_per_s": steps / span,
                    "ms_per_step": per_step})  # fmt: skip
    return out


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    import chaos_harness as ch
    from helpers import netns

    from .chaos_cpu import role
    from .faults import guide_job

    out = Path(args.keep or tempfile.mkdtemp(prefix="cutoff-"))
    out.mkdir(parents=True, exist_ok=True)
    samples: list[dict[str, Any]] = []
    with netns.make(f"co{os.getpid() % 1000}", 4, subnet=args.subnet) as machines:
        job = guide_job(machines, out, 1, args.timeout, True, port=29577, restarts=5)
        faults = ch.start(job, 3, [0, 1, 2])
        faults.wake = True
        marks = {"before": time.time()}

        def sample(until: float) -> None:
            while time.time() < until:
                pids = {m: netns.pids(machines.name(m)) for m in range(4)}
                cpu = {m: cpu_seconds(p) for m, p in pids.items()}
                each = {pid: cpu_seconds([pid]) for p in pids.values() for pid in p}  # (which process of it)
                where = {pid: f"m{m} {role(pid)}" for m, p in pids.items() for pid in p}
                samples.append({"t": time.time(), "cpu": cpu, "steps": len(faults.rows()), "pids": each,
                                "where": where})  # fmt: skip
                time.sleep(1.0)

        sample(marks["before"] + args.before)
        marks["lost"] = faults.lose(args.kind, args.machine).at
        sample(marks["lost"] + args.down)
        marks["back"] = faults.back(args.machine).at
        if args.after > args.settle:  # the newcomers' boot and join apart from the generation they then run in
            sample(marks["back"] + args.settle)
            marks["joined"] = time.time()
        sample(marks["back"] + args.after)
        ch.stop_all(machines)
    (out / "cutoff.json").write_text(json.dumps({"samples": samples, "marks": marks}))
    return phases(samples, marks)


def report(found: list[dict[str, Any]], kind: str, machine: int) -> str:
    lines = [f"| phase ({kind} of machine {machine}) | seconds | cores used by machine 0 / 1 / 2 / store | steps/s |",
             "|---|---|---|---|"]  # fmt: skip
    for p in found:
        cores = " / ".join(f"{p['cores'][m]:.2f}" for m in sorted(p["cores"]))
        lines.append(f"| {p['phase']} | {p['seconds']:.0f} | {cores} | {p['steps_per_s']:.2f} |")
    lines.append("CPU ms per step of the job, by process (machine, role, pid), per phase:")
    for p in found:
        each = sorted((k, v) for k, v in p.get("ms_per_step", {}).items() if "worker" in k or "launcher" in k)
        lines.append(f"  {p['phase']}: " + ", ".join(f"{k} {v:.1f}" for k, v in each))
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    load = os.getloadavg()[0]
    found = run(args)
    print(report(found, args.kind, args.machine))
    print(f"load (1 min) {load:.1f}-{os.getloadavg()[0]:.1f}")
    return 0


def add(sub: Any) -> None:
    p = sub.add_parser("cutoff", help="a lost machine's CPU use on the shared cores, and the survivors' rate")
    p.add_argument("--kind", default="partition", choices=["partition", "stop", "kill"])
    p.add_argument("--machine", type=int, default=0)
    p.add_argument("--before", type=float, default=20.0, help="seconds measured before the loss")
    p.add_argument("--down", type=float, default=50.0, help="seconds the machine stays lost")
    p.add_argument("--after", type=float, default=20.0, help="seconds measured after it is back")
    p.add_argument("--settle", type=float, default=30.0, help="of --after: its boot and join (a phase apart)")
    p.add_argument("--timeout", type=float, default=10.0, help="the pipeline's hang threshold, seconds")
    p.add_argument("--subnet", type=int, default=63)
    p.add_argument("--keep", default=None, help="a folder for the job's logs and samples")
