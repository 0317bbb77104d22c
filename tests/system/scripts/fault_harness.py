"""Run cases of the fault matrix (tests/system/scripts/fault_matrix.py) and judge them; shared by the test and the soak.

A case is (fault, victim rank, where). Its four ranks are plain processes with torchrun's environment variables
(rank 0 hosts the store). The judge checks exit codes and messages only - never how long anything took:

* the victim: killed by SIGKILL (-9), still stopped (SIGSTOP; killed here afterwards), or exit 1 (exception);
* every other rank: exit code 1 (the exit hook), a report starting ``PipelineError:`` that names the victim
  (``rank V``), or - when rank 0, the store host, is killed or stopped - says the coordinator is unreachable;
* no rank aborts (exit -6, "terminate called", "Fatal Python error"); none hangs (the wait below is a guard).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

WORKER = Path(__file__).parent / "fault_matrix.py"
WORLD = 4
FAULTS = ("sigkill", "sigstop", "exception")
VICTIMS = (0, 1, WORLD - 1)
WHERES = ("step", "constructor", "clip")
HANG_GUARD_S = 240.0  # a guard against hangs on a loaded machine, not a bound anything is measured against
UNREACHABLE = "the coordinator (store host, rank 0) is unreachable"

Case = tuple[str, int, str]
ALL_CASES: list[Case] = [(f, v, w) for f in FAULTS for v in VICTIMS for w in WHERES]


@dataclass
class Outcome:
    case: Case
    codes: dict[int, int | None]  # None: still running when the others were done (a stopped victim)
    reports: dict[int, str]
    logs: dict[int, str]
    problems: list[str] = field(default_factory=list)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_job(
    out: Path, fault: str, victim: int, where: str, worker: Path = WORKER
) -> tuple[dict[int, int | None], dict[int, str], dict]:
    """Start the four ranks of ``worker``; wait for all but a stopped victim; return exit codes, reports, logs."""
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs = {}
    logs = {}
    for r in range(WORLD):
        env = dict(
            os.environ,
            RANK=str(r),
            LOCAL_RANK=str(r),
            WORLD_SIZE=str(WORLD),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            PYTHONUNBUFFERED="1",
            PYTHONFAULTHANDLER="1",
        )
        for k in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_USE_AGENT_STORE"):
            env.pop(k, None)
        logs[r] = open(out / f"log{r}.txt", "w")
        cmd = [sys.executable, str(worker), "--fault", fault, "--victim", str(victim), "--where", where]
        procs[r] = subprocess.Popen([*cmd, "--out", str(out)], env=env, stdout=logs[r], stderr=subprocess.STDOUT)
    codes: dict[int, int | None] = {}
    started = time.monotonic()
    try:
        for r, p in procs.items():
            if fault == "sigstop" and r == victim:
                continue
            try:
                p.wait(timeout=max(1.0, HANG_GUARD_S - (time.monotonic() - started)))
            except subprocess.TimeoutExpired:
                pass
            codes[r] = p.poll()
    finally:
        for r, p in procs.items():
            if p.poll() is None:
                codes.setdefault(r, None)
                p.send_signal(signal.SIGKILL)
            elif r not in codes:
                codes[r] = p.returncode
            p.wait()
            logs[r].close()
    reports = {r: (out / f"rank{r}.txt").read_text() for r in range(WORLD) if (out / f"rank{r}.txt").exists()}
    texts = {r: (out / f"log{r}.txt").read_text(errors="replace") for r in range(WORLD)}
    return codes, reports, texts


def judge(case: Case, codes: dict[int, int | None], reports: dict[int, str], logs: dict[int, str]) -> list[str]:
    fault, victim, where = case
    problems = []
    want_victim = {"sigkill": -signal.SIGKILL, "sigstop": None, "exception": 1}[fault]
    if codes.get(victim) != want_victim:
        problems.append(f"victim rank {victim} exited {codes.get(victim)}, expected {want_victim}")
    if fault == "exception" and "ValueError: the tripwire fired" not in reports.get(victim, ""):
        problems.append(f"victim rank {victim} did not report its own error: {reports.get(victim, '')[:300]!r}")
    coordinator_gone = victim == 0 and fault != "exception"
    for r in range(WORLD):
        log = logs.get(r, "")
        for sign in ("terminate called", "Fatal Python error", "core dumped"):
            if sign in log:
                problems.append(f"rank {r} aborted: {sign!r} in its log")
        if r == victim:
            continue
        if codes.get(r) != 1:
            problems.append(f"rank {r} exited {codes.get(r)}, expected 1 (None: hung)")
        text = reports.get(r, "")
        if not text.startswith("PipelineError: "):
            problems.append(f"rank {r} did not raise a PipelineError: {text[:300]!r}")
            continue
        names_victim = re.search(rf"\brank {victim}\b", text) is not None
        if not (names_victim or (coordinator_gone and UNREACHABLE in text)):
            problems.append(f"rank {r}'s error names neither rank {victim} nor the coordinator: {text[:400]!r}")
    return problems


def run_case(case: Case, out: Path, worker: Path = WORKER) -> Outcome:
    codes, reports, logs = run_job(out, *case, worker=worker)
    return Outcome(case, codes, reports, logs, judge(case, codes, reports, logs))


def run_cases(cases: list[Case], out: Path, parallel: int = 2, worker: Path = WORKER) -> list[Outcome]:
    """The cases, ``parallel`` jobs at a time (each job is four processes of ``worker``)."""
    names = [f"{f}-rank{v}-{w}" for f, v, w in cases]
    with ThreadPoolExecutor(parallel) as pool:
        return list(pool.map(lambda c, n: run_case(c, out / n, worker), cases, names))


def clean_job(out: Path) -> tuple[dict[int, int | None], dict[int, str], dict]:
    """A job with no fault (trains and clips two steps; every rank exits 0)."""
    return run_job(out, "none", -1, "step")
