"""Machines lost in three ways and taken back, under the elastic guide's command: the recovery benchmark's and the
chaos run's harness (benchmarks/recovery, tests/system/test_chaos.py).

The job is steady_train.py on namespace machines (:mod:`helpers.netns`) started the way docs/guides/elastic.md
shows: ``stagewise run -n 2 --nnodes 2:3 --max-restarts N --rdzv-endpoint STORE --rdzv-id ID --local-addr ADDR``
with torch's rendezvous settings left to stagewise's defaults (no ``--rdzv-conf``), and the store hosted apart
by ``stagewise rendezvous`` on a machine that runs no workers, as the guide advises - so any training machine
may be lost. ``extra`` adds ``stagewise run`` flags (another recovery path) and ``program`` replaces the script.

A loss is one of :data:`recovery_log.LOSSES`: ``kill`` (SIGKILL to every process of the machine), ``stop``
(SIGSTOP to each: a hung machine) or ``partition`` (its link set down: its processes run on, unreachable).
:meth:`Faults.back` takes the machine back as after a reboot: whatever is left of it is killed, its link set
up, and ``stagewise run`` started there again with empty memory. With ``wake`` (the in-place path) a stopped
machine is first woken (SIGCONT) and a cut-off one's link set up with its processes alive, and ``stagewise
run`` started beside them: the woken processes are behind the job's generation and must leave on their own
(fenced, exit status 3) - :meth:`Faults.woken` says what each did.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import elastic_train
import steady_train
from elastic_harness import Job
from helpers import netns
from recovery_log import Event, Row


@dataclass
class GuideJob(Job):
    """:class:`elastic_harness.Job` with the guide's command: no ``--rdzv-conf``, ``--rdzv-id`` given, a store apart."""

    job_id: str = "recovery"
    program: str = steady_train.__file__
    extra: list[str] = field(default_factory=list)

    def run_args(self, i: int) -> list[str]:
        assert self.store is not None, "host the store first (host_store)"
        args = ["-n", str(self.nproc), "--nnodes", self.nnodes, "--max-restarts", str(self.restarts)]
        args += ["--rdzv-endpoint", self.store, "--rdzv-id", self.job_id, "--local-addr", self.machines.addr(i)]
        return [*args, *self.extra, self.program, "--out", str(self.out), *self.script]


def veth(machines: netns.Machines, i: int) -> str:
    return f"{machines.tag}v{i}"


def link(machines: netns.Machines, i: int, state: str) -> None:
    subprocess.run(["ip", "-n", machines.name(i), "link", "set", veth(machines, i), state], check=True, timeout=30)


def signal_all(machines: netns.Machines, i: int, sig: signal.Signals) -> float:
    for pid in netns.pids(machines.name(i)):
        try:
            os.kill(int(pid), sig)
        except ProcessLookupError:
            pass
    return time.time()


@dataclass
class Faults:
    """Loses and takes back machines of ``job``; remembers every event and each machine's log length at it."""

    job: GuideJob
    workers: list[int]
    events: list[Event] = field(default_factory=list)
    lines_at: list[dict[int, int]] = field(default_factory=list)  # per event: machine -> lines in its log
    down: dict[int, str] = field(default_factory=dict)
    wake: bool = False  # a stopped / cut-off machine woken, not killed, before it is started again
    woke: list[dict[str, object]] = field(default_factory=list)  # :meth:`woken` at the end of :func:`chaos`
    _woken: list[tuple[int, str, subprocess.Popen[bytes] | None, int]] = field(default_factory=list)

    def world(self) -> int:
        return self.job.nproc * (len(self.workers) - len(self.down))

    def lose(self, kind: str, i: int) -> Event:
        machines = self.job.machines
        self.lines_at.append(self.log_lines())
        if kind == "kill":
            at = self.job.lose(i)
        elif kind == "stop":
            at = signal_all(machines, i, signal.SIGSTOP)
        elif kind == "partition":
            link(machines, i, "down")
            at = time.time()
        else:
            raise ValueError(f"a loss is kill, stop or partition, not {kind!r}")
        self.down[i] = kind
        return self._event(kind, i, at)

    def back(self, i: int) -> Event:
        machines = self.job.machines
        kind = self.down.pop(i)
        self.lines_at.append(self.log_lines())
        if kind != "kill" and self.wake:  # its old launcher, and the log's "fenced" lines so far
            launched = machines.jobs.get(i, [])
            self._woken.append((i, kind, launched[-1] if launched else None, self._fenced_lines(i)))
            if kind == "stop":
                signal_all(machines, i, signal.SIGCONT)
        elif kind != "kill":
            machines.kill(i)  # (SIGKILL ends a stopped process too)
        if kind == "partition":
            link(machines, i, "up")
        at = time.time()
        self.job.start(i)
        return self._event("back", i, at)

    def _event(self, kind: str, i: int, at: float) -> Event:
        event = Event(kind, i, at, self.world())
        self.events.append(event)
        with open(self.job.out / "events.jsonl", "a") as f:  # (a run cut short can still be read)
            f.write(json.dumps({**event.__dict__, "lines": self.lines_at[-1]}) + "\n")
        return event

    def log_lines(self) -> dict[int, int]:
        logs = {i: self.job.log(i) for i in self.workers}
        return {i: p.read_bytes().count(b"\n") if p.exists() else 0 for i, p in logs.items()}

    def woken(self, timeout: float = 60.0) -> list[dict[str, object]]:
        """Each machine woken (``wake``): its old launcher's exit status (None: still running after ``timeout``)
        and how many lines saying "fenced" its log gained."""
        out = []
        for i, kind, launcher, before in self._woken:
            status = None
            if launcher is not None:
                try:
                    status = launcher.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    pass
            out.append({"machine": i, "kind": kind, "exit": status, "fenced_lines": self._fenced_lines(i) - before})
        return out

    def _fenced_lines(self, i: int) -> int:
        path = self.job.log(i)
        return path.read_bytes().count(b"fenced") if path.exists() else 0

    def rows(self) -> list[Row]:
        return self.job.rows("steps.jsonl")

    def absorbed(self, event: Event, timeout: float, more: int = 0) -> Row:
        """Wait for the first committed step at ``event``'s world after it, and ``more`` steps after that one."""
        found: list[Row] = []

        def done() -> bool:
            rows = [r for r in self.rows() if r["time"] >= event.at]
            first = next((k for k, r in enumerate(rows) if r["world"] == event.world), None)
            if first is not None and len(rows) > first + more:
                found.append(rows[first])
                return True
            return False

        netns.wait_for(f"the job at {event.world} processes after {event}", done, timeout, self.job.tails)
        return found[0]

    def lines_per_machine(self, k: int) -> dict[int, int]:
        """Lines each machine that stayed up printed from event ``k`` to the next one (or now)."""
        after = self.lines_at[k + 1] if k + 1 < len(self.lines_at) else self.log_lines()
        event = self.events[k]
        return {i: after[i] - self.lines_at[k][i] for i in self.workers if i != event.machine}


def start(job: GuideJob, store_machine: int, workers: list[int], timeout: float = 600, more: int = 5) -> Faults:
    """Host the store, start every worker machine, and wait for ``more`` steps after the first at full size."""
    job.store = job.host_store(store_machine)
    time.sleep(1.0)
    job.start(*workers)
    faults = Faults(job, workers)
    faults.absorbed(Event("start", -1, 0.0, faults.world()), timeout, more)
    return faults


def stop_all(machines: netns.Machines) -> None:
    """Kill every machine and set every link up again (a partitioned one's too)."""
    for i in range(machines.n):
        machines.kill(i)
        link(machines, i, "up")


def throughput(job: GuideJob, store_machine: int, workers: list[int], seconds: float) -> tuple[float, list[float]]:
    """Steps per second of a fault-free job on ``workers`` (after its first steps), and of each quarter of the
    measurement (how much the rate itself moves); then the job is stopped."""
    faults = start(job, store_machine, workers)
    began = time.time()
    time.sleep(seconds)
    times = [r["time"] for r in faults.rows() if began < r["time"] <= began + seconds]
    stop_all(job.machines)
    q = seconds / 4
    quarters = [sum(1 for t in times if began + k * q < t <= began + (k + 1) * q) / q for k in range(4)]
    return len(times) / seconds, quarters


def replay(out: Path, rows: list[Row], resumes: list[Row], limit: int = 0, timeout: float = 1800) -> list[Row]:
    """Each run of the job (a process group, from its start or its resume) replayed by a fresh job of its size
    started from the same step (elastic_train.py, ``--reference`` the state saved at the resume); its losses
    against the run's, float64, bit for bit. ``limit``: at most that many steps of each run (0: all)."""
    runs: dict[str, list[Row]] = {}
    for r in sorted(rows, key=lambda r: r["time"]):
        runs.setdefault(r["run"], []).append(r)
    begun = {r["run"]: r for r in resumes}
    found = []
    for run, its in runs.items():
        world = its[0]["world"]
        frm = begun[run]["step"] if run in begun else 0
        to = its[-1]["step"] if not limit else min(its[-1]["step"], frm + limit)
        folder = out / "replay" / run
        cmd = [sys.executable, "-m", "stagewise.cli.main", "run", "-n", str(world), elastic_train.__file__]
        cmd += ["--out", str(folder), "--steps", str(to)]
        if frm:
            name = f"w{world}-s{frm}"
            cmd += ["--reference", str(out / "resumed" / name)]
            table = folder / f"reference-{name}.jsonl"
        else:
            cmd += ["--no-snapshots", "--save-every", str(10**9)]
            table = folder / "losses.jsonl"
        folder.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_replay_env())
        want = {}
        if done.returncode == 0:
            want = {r["step"]: r["loss"] for r in map(json.loads, table.read_text().splitlines())}
        got = {r["step"]: r["loss"] for r in its if r["step"] <= to}
        differ = [s for s in sorted(got) if want.get(s) != got[s]]
        error = "" if done.returncode == 0 else done.stderr[-2000:]
        found.append({"run": run, "world": world, "from": frm, "to": to, "steps": len(got), "differ": differ,
                      "replayed": done.returncode == 0, "error": error})  # fmt: skip
    return found


def _replay_env() -> dict[str, str]:
    paths = [netns.REPO / "src", netns.REPO / "tests", netns.REPO / "tests/system/scripts"]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, paths)), "OMP_NUM_THREADS": "1",
            "PYTHONWARNINGS": "ignore"}  # fmt: skip


def chaos(job: GuideJob, plan: list[tuple[float, str, int]], duration: float, store_machine: int = 3,
          workers: tuple[int, ...] = (0, 1, 2), absorb: float = 0.0, wake: bool = False) -> tuple[
    Faults, float, float
]:  # fmt: skip
    """Run ``plan`` (:func:`recovery_log.schedule`) on a job started here, from its first steps at full size for
    ``duration`` seconds; then stop every machine. The faults (events, log lines), the start and the end.
    ``absorb``: after each event, wait (up to that many seconds) for the job to train at its new size before
    going on - the order of events then holds on a machine of any speed (a test), the times are a floor.
    ``wake``: see :class:`Faults` (call :meth:`Faults.woken` before the machines are stopped)."""
    faults = start(job, store_machine, list(workers))
    faults.wake = wake
    began = time.time()
    for at, kind, machine in plan:
        time.sleep(max(0.0, began + at - time.time()))
        event = faults.back(machine) if kind == "back" else faults.lose(kind, machine)
        if absorb:
            faults.absorbed(event, absorb)
    time.sleep(max(0.0, began + duration - time.time()))
    ended = time.time()
    faults.lines_at.append(faults.log_lines())
    faults.woke = faults.woken(timeout=1.0)  # (launchers still running now: None)
    stop_all(job.machines)
    return faults, began, ended
