"""A lost machine, before and after the in-place recovery: fault -> the survivors' first step, steps redone.

    .venv/bin/python -m benchmarks.elastic_inplace --trials 3                       # kill, both paths
    .venv/bin/python -m benchmarks.elastic_inplace --paths inplace --cases kill stop --trials 20 --json out.json

Machines are processes of one host (no root): each has its own memory folder for snapshots; the job is a
float64 MLP at ``ElasticLayout(pp=1, batch=24, microbatch_size=2)`` with a snapshot every step
(tests/system/scripts). Per trial every machine trains to ``--hold``, waits; machine ``count - 1`` is lost
(``kill``: SIGKILL to every worker of it; ``stop``: SIGSTOP, the hang threshold - the script's
``timeout=10`` - decides) and the others are told to go on. Measured from the fault:

* ``inplace``: ``sw.runtime.InPlace`` workers on ``stagewise rendezvous``'s store (tests/system/scripts/
  inplace_machines.py): the survivors keep their processes;
* ``restart`` (``kill`` only): today's path, ``stagewise run --nnodes 2:3`` per machine on localhost (the
  rendezvous settings the tests use; tests/system/scripts/elastic_local.py): torch's agents restart every
  survivor, which resumes from the peers' snapshots.

Printed per path and case: seconds from the fault to the survivors' first step (the first loss of the new
membership written by its rank 0 - every stage has stepped), p50 / p95 / max; in place, where they went
(p50 of each part: ``detect``, the fault to the failure seen by the last survivor; ``recover``, that
survivor's drop + agreement + group + build + resume; ``step``, the rest: the first step at the new size);
steps redone (losses of steps at or below the last step before the fault written again); committed steps
rolled back (new membership resuming below the held step); and the load (``uptime``) at the start and the
end. A partition (a machine's link down) needs network namespaces: ``benchmarks.recovery faults``. The
chaos benchmark calls :func:`trial`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ._launch import ROOT, with_the_tests

SCRIPTS = ROOT / "tests" / "system" / "scripts"


def trial(
    path: str, folder: Path, machines: int = 3, hold: int = 4, steps: int = 8, case: str = "kill"
) -> dict[str, Any]:
    """One loss (``case``: kill or stop) of the last machine on ``path`` (``inplace`` or ``restart``): seconds
    to the first step of the new membership, where they went (in place), steps redone, committed steps
    rolled back."""
    if path == "inplace":
        killed, rows = _inplace(folder, machines, hold, steps, case)
    else:
        killed, rows = _restart(folder, machines, hold, steps)
    after = [r for r in rows if r["world"] < machines]
    before = max(r["step"] for r in rows if r["world"] == machines)
    return {
        "path": path,
        "case": case,
        "seconds": after[0]["t"] - killed if after else None,
        **(_parts(folder, killed, after[0]["t"]) if after and path == "inplace" else {}),
        "redone": sum(1 for r in after if r["step"] <= before),
        "rolled_back": max(0, before - (after[0]["step"] - 1)) if after else None,
        "first_step": after[0]["step"] if after else None,
    }


def _parts(folder: Path, fault: float, first: float) -> dict[str, Any]:
    """Where the seconds went: ``detect`` until the last survivor saw the failure, ``recover`` until the last
    one's state was back (its ``recovered`` event), ``step`` the rest; ``parts``: that last one's
    :class:`~stagewise.runtime.relayout.generation.Recovery` parts."""
    events = [json.loads(x) for x in (folder / "events.jsonl").read_text().splitlines()]
    done = [e for e in events if e["what"] == "recovered"]
    seen = max(e["t"] - e["seconds"] for e in done)
    last = max(done, key=lambda e: e["t"])
    return {"detect": seen - fault, "recover": last["t"] - seen, "step": first - last["t"], "parts": last["parts"]}


def _inplace(folder: Path, count: int, hold: int, steps: int, case: str) -> tuple[float, list[dict[str, Any]]]:
    from inplace_machines import Machines

    m = Machines(folder, count, job=f"b{os.getpid()}{time.monotonic_ns() % 10**6}")
    try:
        m.start(["--hold", str(hold), "--steps", str(steps), "--no-count"])
        m.wait_for("hold-*", count)
        fault = time.time()
        if case == "kill":
            m.lose(count - 1)
        else:
            m.signal(count - 1, signal.SIGSTOP)
        (m.out / "go").touch()
        for i in range(count - 1):
            m.wait(i)
        return fault, m.rows("losses.jsonl")
    finally:
        m.close()


def _restart(folder: Path, count: int, hold: int, steps: int) -> tuple[float, list[dict[str, Any]]]:
    folder.mkdir(parents=True, exist_ok=True)
    port = 29800 + os.getpid() % 100
    procs = []
    job = f"b{port}{time.monotonic_ns() % 10**6}"  # the job's name, alike on every machine
    for i in range(count):
        cmd = [sys.executable, "-W", "ignore", "-m", "stagewise.cli.main", "run", "-n", "1", "--nnodes",
               f"{count - 1}:{count}", "--max-restarts", "3", "--rdzv-endpoint", f"127.0.0.1:{port}",
               "--rdzv-id", job, "--local-addr", "127.0.0.1",
               "--rdzv-conf", "join_timeout=60", *(["--rdzv-host"] if i == 0 else []),
               str(SCRIPTS / "elastic_local.py"), "--out", str(folder), "--hold", str(hold),
               "--steps", str(steps)]  # fmt: skip
        env = dict(
            os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", STAGEWISE_SNAPSHOT_DIR=str(folder / f"shm{i}")
        )
        log = open(folder / f"machine{i}.log", "ab")  # noqa: SIM115 (closed with the process)
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True))
    try:
        while len(list(folder.glob("hold-r*"))) < count:
            if any(p.poll() is not None for p in procs):
                raise RuntimeError(f"a machine ended before the loss: see {folder}/machine*.log")
            time.sleep(0.1)
        killed = time.time()
        _kill_tree(procs[-1].pid)
        (folder / "go").touch()
        for p in procs[:-1]:
            p.wait(600)
        rows = [json.loads(line) for line in (folder / "losses.jsonl").read_text().splitlines()]
        return killed, rows
    finally:
        for p in procs:
            _kill_tree(p.pid)


def _kill_tree(pid: int) -> None:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout.split()
    for child in out:
        _kill_tree(int(child))
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _load() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--paths", nargs="+", default=["restart", "inplace"], choices=["restart", "inplace"])
    p.add_argument("--cases", nargs="+", default=["kill"], choices=["kill", "stop"], help="stop: in place only")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--machines", type=int, default=3)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    with_the_tests("benchmarks.elastic_inplace", "inplace_machines")  # the tests' machines on one host
    print(f"load at the start: {_load()}")
    results: list[dict[str, Any]] = []
    runs = [(path, case) for case in args.cases for path in args.paths if path == "inplace" or case == "kill"]
    with tempfile.TemporaryDirectory(prefix="elastic-inplace-") as tmp:
        for k in range(args.trials):
            for path, case in runs:  # alternating, so that the load drifts alike
                row = trial(path, Path(tmp) / f"{path}-{case}{k}", args.machines, case=case)
                print(json.dumps(row), flush=True)
                results.append(row)
    print(f"load at the end: {_load()}")
    for path, case in runs:
        print(summary([r for r in results if r["path"] == path and r["case"] == case], f"{path} {case}"))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))


def spread(values: list[float]) -> str:
    """p50 / p95 / max (p95: the nearest rank at or above 95 %)."""
    v = sorted(values)
    p95 = v[min(len(v) - 1, math.ceil(0.95 * len(v)) - 1)]
    return f"{statistics.median(v):.2f} / {p95:.2f} / {v[-1]:.2f}"


def summary(rows: list[dict[str, Any]], name: str) -> str:
    secs = [r["seconds"] for r in rows if r["seconds"] is not None]
    if not secs:
        return f"{name}: no trial recovered"
    line = f"{name:16s} fault -> first step p50 / p95 / max: {spread(secs)} s ({len(secs)} of {len(rows)} trials)"
    if "detect" in rows[0]:
        parts = {k: statistics.median(r[k] for r in rows if k in r) for k in ("detect", "recover", "step")}
        line += "; p50 " + ", ".join(f"{k} {v:.2f} s" for k, v in parts.items())
    redone, back = max(r["redone"] for r in rows), max(r["rolled_back"] or 0 for r in rows)
    return line + f"; steps redone max {redone}; committed steps rolled back max {back}"


if __name__ == "__main__":
    main()
