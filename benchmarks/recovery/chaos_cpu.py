"""Why the chaos job runs slower than the fault-free job of its size: CPU seconds per step, per process.

The chaos report normalises by separate fault-free jobs (:func:`chaos_harness.throughput`); the chaos job's own
first minute, before any event, ran 19 % below that in the 12:27 quiet run. Wall-clock rates on a shared VM
move with its load; CPU time per step (``/proc/<pid>/stat`` utime + stime, :func:`cutoff.cpu_seconds`) much
less. This starts jobs of 3 machines x 2 processes one after another, alternating configurations (``fault-free``:
as chaos.py measures the normaliser; ``chaos``: as it starts the chaos job; ``--variant`` more), samples every
process of each machine for ``--seconds`` after its first steps, and prints per configuration: steps per second,
CPU seconds per step of each worker and of each launcher, and the store's.

    sudo OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.recovery chaos-cpu --rounds 2 --seconds 30
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

#: configuration -> (steady_train.py flags, `stagewise run` flags, --max-restarts); the first two are chaos.py's
VARIANTS: dict[str, tuple[list[str], list[str], int]] = {
    "fault-free": ([], [], 3),
    "chaos": (["--keep-resumed"], [], 14),
    "no-snapshots": (["--every", "0"], [], 3),
}


def role(pid: str) -> str:
    """``worker``, ``launcher`` or ``store`` from a process's command line (``other``: a shell, ``ip``)."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "gone"
    text = b" ".join(cmd)
    if b"steady_train" in text and b"stagewise.cli.main" not in text:
        return "worker"
    if b"stagewise.cli.main" in text:
        return "store" if b"rendezvous" in text else "launcher"
    return "other"


def one(machines: Any, out: Path, name: str, port: int, seconds: float, timeout: float) -> dict[str, Any]:
    """One job of ``name``'s configuration: its steps per second and each process's CPU seconds per step."""
    import chaos_harness as ch
    from helpers import netns

    from .cutoff import cpu_seconds
    from .faults import guide_job

    flags, extra, restarts = VARIANTS[name]
    job = guide_job(machines, out, 1, timeout, True, port=port, restarts=restarts, script=flags, extra=extra)
    faults = ch.start(job, 3, [0, 1, 2])
    pids = {m: netns.pids(machines.name(m)) for m in range(4)}
    roles = {pid: (m, role(pid)) for m, p in pids.items() for pid in p}
    first = {pid: cpu_seconds([pid]) for pid in roles}
    steps0, t0 = len(faults.rows()), time.time()
    time.sleep(seconds)
    last = {pid: cpu_seconds([pid]) for pid in roles}
    steps, wall = len(faults.rows()) - steps0, time.time() - t0
    ch.stop_all(machines)
    each: dict[str, list[float]] = {}
    for pid, (_m, what) in roles.items():
        each.setdefault(what, []).append((last[pid] - first[pid]) / max(steps, 1))
    return {"variant": name, "steps": steps, "seconds": wall, "rate": steps / wall, "cpu_per_step": each,
            "load": os.getloadavg()[0]}  # fmt: skip


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    from helpers import netns

    out = Path(args.keep or tempfile.mkdtemp(prefix="chaos-cpu-"))
    found = []
    with netns.make(f"cc{os.getpid() % 1000}", 4, subnet=args.subnet) as machines:
        for k in range(args.rounds):
            for j, name in enumerate(args.variant):
                got = one(machines, out / f"{name}-{k}", name, 29590 + j + 4 * k, args.seconds, args.timeout)
                print(line(got), flush=True)
                found.append(got)
    (out / "chaos-cpu.json").write_text(json.dumps(found, indent=1))
    return found


def line(g: dict[str, Any]) -> str:
    def ms(what: str) -> str:
        v = g["cpu_per_step"].get(what, [])
        return "/".join(f"{1000 * x:.1f}" for x in sorted(v)) or "-"

    return (f"{g['variant']}: {g['rate']:.2f} steps/s ({g['steps']} in {g['seconds']:.0f} s, load {g['load']:.1f}); "
            f"CPU ms per step: workers {ms('worker')}, launchers {ms('launcher')}, store {ms('store')}, "
            f"other {ms('other')}")  # fmt: skip


def main(args: argparse.Namespace) -> int:
    run(args)
    return 0


def add(sub: Any) -> None:
    p = sub.add_parser("chaos-cpu", help="CPU seconds per step of the chaos job's configuration and the normaliser's")
    p.add_argument("--variant", nargs="+", default=["fault-free", "chaos"], choices=sorted(VARIANTS))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seconds", type=float, default=30.0, help="seconds sampled after each job's first steps")
    p.add_argument("--timeout", type=float, default=10.0, help="the pipeline's hang threshold, seconds")
    p.add_argument("--subnet", type=int, default=64)
    p.add_argument("--keep", default=None, help="a folder for the jobs' logs")
