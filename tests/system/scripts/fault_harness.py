"""Run cases of the fault matrix (tests/system/scripts/fault_matrix.py) and judge them; shared by the tests, the
``make fault-matrix`` run of the whole product and the soak (benchmarks/fault_soak.py).

A case is (fault, victim rank, where). Its four ranks are plain processes with torchrun's environment variables
(rank 0 hosts the store). The judge checks exit codes and messages only - never how long anything took:

* the victim: killed by SIGKILL (-9), still stopped (SIGSTOP; killed here afterwards), or exit 1 (exception);
* every other rank: exit code 1 (the exit hook), a report starting ``PipelineError:`` whose *first line* blames
  the victim - the first rank it names is the victim (``rank V``, ``global rank V``, or ``rank P (global rank
  V...``) - or, when rank 0, the store host, is killed or stopped, says the coordinator is unreachable;
* no rank aborts (exit -6, "terminate called", "Fatal Python error"); none hangs (the wait below is a guard,
  derived from the pipelines' timeout: not a bound anything is measured against).

How long each survivor took to raise, from the moment the victim fired, is recorded (``Outcome.latency``) for
the soak's figures; no test judges it.
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
WHERES = ("step", "constructor", "clip", "eval", "save", "load", "stream", "wave")
TIMEOUT = 10.0  # the pipelines' timeout in the matrix's jobs
STARTUP_S = 90.0  # four interpreters importing torch on a loaded 2-core machine (one was seen to take 46 s)
UNREACHABLE = "the coordinator (store host, rank 0) is unreachable"

Case = tuple[str, int, str]
ALL_CASES: list[Case] = [(f, v, w) for f in FAULTS for v in VICTIMS for w in WHERES]


def hang_guard(timeout: float) -> float:
    """How long a job may run before its ranks count as hung: start-up, then a few timeouts' worth of waits
    (a failure is seen within one timeout and a few seconds; leaving takes one more). A guard, not a bound."""
    return STARTUP_S + 8 * timeout


HANG_GUARD_S = hang_guard(60.0)  # for jobs of programs with a 60 s timeout (the torchrun summary test)


@dataclass
class Outcome:
    case: Case
    codes: dict[int, int | None]  # None: still running when the others were done (a stopped victim)
    reports: dict[int, str]
    logs: dict[int, str]
    problems: list[str] = field(default_factory=list)
    latency: float | None = None  # seconds from the fault to the last survivor's error (not judged)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_job(
    out: Path, fault: str, victim: int, where: str, worker: Path = WORKER, timeout: float | None = TIMEOUT
) -> tuple[dict[int, int | None], dict[int, str], dict]:
    """Start the four ranks of ``worker``; wait for all but a stopped victim; return exit codes, reports, logs.
    ``timeout``: passed to the worker as ``--timeout`` (None: the worker's own), and the hang guard's base."""
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
        cmd += [] if timeout is None else ["--timeout", str(timeout)]
        procs[r] = subprocess.Popen([*cmd, "--out", str(out)], env=env, stdout=logs[r], stderr=subprocess.STDOUT)
    codes: dict[int, int | None] = {}
    guard = hang_guard(60.0 if timeout is None else timeout)
    started = time.monotonic()
    try:
        for r, p in procs.items():
            if fault == "sigstop" and r == victim:
                continue
            try:
                p.wait(timeout=max(1.0, guard - (time.monotonic() - started)))
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


def blamed(text: str) -> int | None:
    """The first rank the first line of an error names: ``rank N``, ``global rank N``, or - for ``rank P (global
    rank G...`` - G; None if it names none."""
    first = text.splitlines()[0] if text else ""
    m = re.search(r"\b(?:global |pipeline )?rank (\d+)(?: \(global rank (\d+))?", first)
    if m is None:
        return None
    return int(m.group(2) or m.group(1))


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
        first = text.splitlines()[0]
        if not (blamed(text.removeprefix("PipelineError: ")) == victim or (coordinator_gone and UNREACHABLE in first)):
            problems.append(f"rank {r}'s first line blames neither rank {victim} nor the coordinator: {first[:400]!r}")
    return problems


def latency(out: Path, codes: dict[int, int | None], victim: int) -> float | None:
    """The longest a survivor took to raise after the victim fired (None if the victim never fired)."""
    fired = out / "fault.time"
    if not fired.exists():
        return None
    at = float(fired.read_text())
    stamps = [out / f"rank{r}.time" for r in codes if r != victim]
    times = [float(p.read_text()) for p in stamps if p.exists()]
    return max(times) - at if times else None


def run_case(case: Case, out: Path, worker: Path = WORKER, timeout: float | None = TIMEOUT) -> Outcome:
    codes, reports, logs = run_job(out, *case, worker=worker, timeout=timeout)
    problems = judge(case, codes, reports, logs)
    if case[0] != "none" and not (out / "fault.time").exists():  # nothing else is worth reading then
        problems.insert(0, f"the fault never landed: victim rank {case[1]} never reached {case[2]!r}")
    return Outcome(case, codes, reports, logs, problems, latency(out, codes, case[1]))


def run_cases(
    cases: list[Case], out: Path, parallel: int = 2, worker: Path = WORKER, timeout: float | None = TIMEOUT
) -> list[Outcome]:
    """The cases, ``parallel`` jobs at a time (each job is four processes of ``worker``)."""
    names = [f"{f}-rank{v}-{w}" for f, v, w in cases]
    with ThreadPoolExecutor(parallel) as pool:
        return list(pool.map(lambda c, n: run_case(c, out / n, worker, timeout), cases, names))


def clean_job(out: Path, where: str = "step") -> tuple[dict[int, int | None], dict[int, str], dict]:
    """A job with no fault (every rank exits 0)."""
    return run_job(out, "none", -1, where)


def describe(o: Outcome) -> str:
    """What each rank ended with, for a failing test's message."""
    return "\n".join(f"--- rank {r} (exit {o.codes.get(r)}) ---\n{o.reports.get(r, '')[:1500]}" for r in range(WORLD))
