"""Machines of an in-place elastic job on one host, for tests and benchmarks (no root).

``stagewise rendezvous --port 0`` hosts the store that outlives the machines; each machine is a set of
worker processes of :mod:`elastic_inplace` (or another script) started the way ``stagewise run --in-place``
starts them: RANK, WORLD_SIZE, GROUP_RANK, STAGEWISE_STORE, TORCHELASTIC_RUN_ID, a memory folder of its
own (STAGEWISE_SNAPSHOT_DIR). ``lose(i)`` SIGKILLs machine i's workers, ``signal(i, SIGSTOP/SIGCONT)`` stops
and wakes them, ``join(i)`` starts machine i again as a newcomer to the running job.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCRIPT = Path(__file__).with_name("elastic_inplace.py")


@dataclass
class Machines:
    out: Path
    count: int
    nproc: int = 1
    job: str = "inplace"
    script: Path = SCRIPT
    store: subprocess.Popen[str] | None = None
    endpoint: str = ""
    procs: dict[int, list[subprocess.Popen[bytes]]] = field(default_factory=dict)
    lost: set[int] = field(default_factory=set)

    def host_store(self) -> str:
        """Start ``stagewise rendezvous`` on a free port; returns host:port."""
        cmd = [
            sys.executable,
            "-W",
            "ignore",
            "-m",
            "stagewise.cli.main",
            "rendezvous",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
        ]
        self.store = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert self.store.stdout is not None
        found = None
        for line in self.store.stdout:  # (a warning of Python's may come first)
            found = re.search(r"store is at ([\d.]+:\d+)", line)
            if found:
                break
        assert found, "stagewise rendezvous printed no address"
        self.endpoint = found.group(1)
        return self.endpoint

    def start(self, args: list[str], world: int | None = None) -> None:
        """Every machine's workers, global ranks machine by machine."""
        self.out.mkdir(parents=True, exist_ok=True)
        if not self.endpoint:
            self.host_store()
        world = world or self.count * self.nproc
        for i in range(self.count):
            self.procs[i] = [self._worker(i, i * self.nproc + j, j, world, args) for j in range(self.nproc)]

    def start_run(self, args: list[str], nnodes: str, only: list[int] | None = None) -> None:
        """Every machine (or ``only`` these) as a user starts it: ``stagewise run -n NPROC --nnodes MIN:MAX
        --in-place`` (torch's rendezvous numbers the machines and ranks; a machine started while the job runs
        joins it)."""
        self.out.mkdir(parents=True, exist_ok=True)
        if not self.endpoint:
            self.host_store()
        for i in range(self.count) if only is None else only:
            self.lost.discard(i)
            cmd = [sys.executable, "-W", "ignore", "-m", "stagewise.cli.main", "run", "-n", str(self.nproc)]
            cmd += ["--nnodes", nnodes, "--in-place", "--rdzv-endpoint", self.endpoint, "--rdzv-id", self.job]
            cmd += ["--local-addr", "127.0.0.1", "--rdzv-conf", "join_timeout=120,last_call_timeout=60"]
            cmd += [str(self.script), "--out", str(self.out), *args]
            env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
            env["STAGEWISE_SNAPSHOT_DIR"] = str(self.out / f"shm{i}")
            log = open(self.log(i), "ab")  # noqa: SIM115 (closed with the process)
            self.procs[i] = [
                subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            ]

    def join(self, i: int, args: list[str]) -> None:
        """Machine i started again (or a spare) while the job runs: its worker asks to join (``STAGEWISE_JOIN=1``,
        no RANK: it claims a fresh id; its machine is named by it), as ``stagewise run --in-place`` starts it on
        a machine that finds its job running. One process per machine here."""
        assert self.nproc == 1, "a newcomer started directly claims its own id: one process per machine"
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        env.update(
            STAGEWISE_JOIN="1", STAGEWISE_STORE=self.endpoint, TORCHELASTIC_RUN_ID=self.job,
            STAGEWISE_SNAPSHOT_DIR=str(self.out / f"shm{i}"),
        )  # fmt: skip
        for name in ("RANK", "WORLD_SIZE", "GROUP_RANK", "LOCAL_RANK"):
            env.pop(name, None)
        log = open(self.log(i), "ab")  # noqa: SIM115 (closed with the process)
        cmd = [sys.executable, str(self.script), "--out", str(self.out), *args]
        self.procs[i] = [subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)]
        self.lost.discard(i)

    def wait_text(self, i: int, text: str, timeout: float = 300) -> None:
        """Until machine i's log says ``text``."""
        end = time.monotonic() + timeout
        while text not in self.text(i):
            if time.monotonic() > end:
                raise TimeoutError(f"machine {i} did not say {text!r} within {timeout} s:\n{self.text(i)[-3000:]}")
            time.sleep(0.1)

    def tree(self, i: int) -> list[int]:
        """Machine i's processes: its launchers and every process under them."""
        return [p for proc in self.procs[i] for p in _tree(proc.pid)]

    def _worker(self, machine: int, rank: int, local: int, world: int, args: list[str]) -> subprocess.Popen[bytes]:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        env.update(
            RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local), LOCAL_WORLD_SIZE=str(self.nproc),
            GROUP_RANK=str(machine), STAGEWISE_STORE=self.endpoint, TORCHELASTIC_RUN_ID=self.job,
            STAGEWISE_SNAPSHOT_DIR=str(self.out / f"shm{machine}"),
        )  # fmt: skip
        log = open(self.log(machine), "ab")  # noqa: SIM115 (closed with the process)
        cmd = [sys.executable, str(self.script), "--out", str(self.out), *args]
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def log(self, i: int) -> Path:
        return self.out / f"machine{i}.log"

    def text(self, i: int) -> str:
        return self.log(i).read_text(errors="replace") if self.log(i).exists() else ""

    def signal(self, i: int, sig: signal.Signals) -> None:
        for pid in self.tree(i):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def lose(self, i: int) -> None:
        self.lost.add(i)
        self.signal(i, signal.SIGKILL)

    def wait(self, i: int, timeout: float = 300) -> list[int]:
        """Exit statuses of machine i's workers (each killed, and None, after ``timeout``)."""
        end = time.monotonic() + timeout
        codes = []
        for proc in self.procs[i]:
            try:
                codes.append(proc.wait(max(1.0, end - time.monotonic())))
            except subprocess.TimeoutExpired:
                proc.kill()
                codes.append(None)
        return codes  # type: ignore[return-value]

    def close(self) -> None:
        for i in self.procs:
            self.lose(i)
        if self.store is not None:
            self.store.terminate()
            try:
                self.store.wait(10)
            except subprocess.TimeoutExpired:  # (a loaded machine)
                self.store.kill()
                self.store.wait(10)

    def rows(self, name: str) -> list[dict[str, Any]]:
        path = self.out / name
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def wait_for(self, pattern: str, n: int, timeout: float = 300) -> None:
        end = time.monotonic() + timeout
        while len(list(self.out.glob(pattern))) < n:
            failed = [i for i, ps in self.procs.items() for p in ps if i not in self.lost and p.poll() not in (None, 0)]
            if failed:
                raise RuntimeError(f"machine {failed[0]} failed before {pattern}:\n{self.text(failed[0])[-3000:]}")
            if time.monotonic() > end:
                raise TimeoutError(f"{n} x {pattern} not there after {timeout} s:\n{self.text(0)[-3000:]}")
            time.sleep(0.1)


def _tree(pid: int) -> list[int]:
    children = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout.split()
    return [pid] + [p for c in children for p in _tree(int(c))]
