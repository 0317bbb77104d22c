"""Machines for elastic tests: Linux network namespaces on one bridge, each with its own memory file system.

Machine ``i`` is a network namespace with its end of a veth pair (``10.232.T.i``, T from the test's tag) and
``lo``; the other ends hang on a bridge in a namespace of their own (the "switch"), so nothing of the host's
network or firewall is involved. Each start of a machine runs in a fresh mount namespace (``ip netns exec``)
with a private tmpfs on ``/dev/shm``: a machine that is killed and started again comes back with empty
memory, as after a reboot - its snapshots are gone, its peers' copies are not. To lose a machine, every
process in its namespace is SIGKILLed (torchrun starts its workers in sessions of their own, so the agent's
process group is not all of them). Needs root (``ip netns``): :func:`make` skips the test otherwise.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


@dataclass
class Machines:
    """``n`` machines joined by a bridge; :meth:`start` runs ``stagewise run`` on one, :meth:`kill` loses it."""

    tag: str
    n: int
    subnet: int
    jobs: dict[int, list[subprocess.Popen[bytes]]] = field(default_factory=dict)

    def name(self, i: int) -> str:
        return f"{self.tag}m{i}"

    def addr(self, i: int) -> str:
        return f"10.232.{self.subnet}.{i + 1}"

    def start(
        self, i: int, run_args: list[str], log: Path, env: dict[str, str] | None = None, command: str = "run"
    ) -> None:
        """``stagewise COMMAND RUN_ARGS`` on machine ``i`` (gloo on its veth), fresh memory; output to ``log``
        (appended)."""
        variables = {
            "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO / "tests"), str(REPO / "tests/system/scripts")]),
            "OMP_NUM_THREADS": "1",
            "PYTHONWARNINGS": "ignore",
            "GLOO_SOCKET_IFNAME": f"{self.tag}v{i}",
            **(env or {}),
        }
        assigned = " ".join(f"{k}={_quote(v)}" for k, v in variables.items())
        line = " ".join(_quote(a) for a in [sys.executable, "-m", "stagewise.cli.main", command, *run_args])
        shell = f"mount -t tmpfs -o size=512m tmpfs /dev/shm && exec env {assigned} {line}"
        out = open(log, "ab")  # noqa: SIM115 (closed with the process)
        job = subprocess.Popen(["ip", "netns", "exec", self.name(i), "sh", "-c", shell], stdout=out, stderr=out)
        self.jobs.setdefault(i, []).append(job)

    def kill(self, i: int) -> float:
        """SIGKILL every process of machine ``i`` (agent, workers, anything); the time it was done."""
        for pid in pids(self.name(i)):
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        killed = time.time()
        for job in self.jobs.get(i, []):
            job.wait(timeout=30)
        return killed

    def wait(self, i: int, timeout: float) -> int | None:
        """The exit status of machine ``i``'s latest start, or None if it is still running after ``timeout``."""
        try:
            return self.jobs[i][-1].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop_all(self) -> None:
        for i in range(self.n):
            self.kill(i)


def pids(namespace: str) -> list[str]:
    """The processes in a network namespace."""
    return subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True).stdout.split()


def _quote(text: str) -> str:
    return shlex.quote(text)


@contextmanager
def make(tag: str, n: int, subnet: int) -> Iterator[Machines]:
    """``n`` machines on a bridge, made here and always deleted (skips the test where not permitted)."""
    if shutil.which("ip") is None:
        pytest.skip("no `ip` command (iproute2): cannot make network namespaces")
    switch = f"{tag}sw"
    made: list[str] = []
    machines = Machines(tag, n, subnet)
    try:
        try:
            _ip("netns", "add", switch)
            made.append(switch)
        except (subprocess.CalledProcessError, OSError) as err:
            reason = getattr(err, "stderr", "") or str(err)
            pytest.skip(f"`ip netns add` is not permitted here (needs root or CAP_SYS_ADMIN): {reason.strip()}")
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        for i in range(n):
            name, veth, port = machines.name(i), f"{tag}v{i}", f"{tag}p{i}"
            _ip("netns", "add", name)
            made.append(name)
            _ip("link", "add", veth, "type", "veth", "peer", "name", port)
            _ip("link", "set", veth, "netns", name)
            _ip("link", "set", port, "netns", switch)
            _ip("-n", switch, "link", "set", port, "master", "br0")
            _ip("-n", switch, "link", "set", port, "up")
            _ip("-n", name, "addr", "add", f"{machines.addr(i)}/24", "dev", veth)
            _ip("-n", name, "link", "set", veth, "up")
            _ip("-n", name, "link", "set", "lo", "up")
        yield machines
    finally:
        for i in range(n):
            if machines.name(i) in made:
                machines.kill(i)
        for name in made:  # deleting a namespace deletes its ends of the veths
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


def wait_for(what: str, done: Callable[[], bool], timeout: float, logs: Callable[[], str]) -> None:
    """Poll ``done()`` until it holds; fail the test with ``what`` and the logs' tails after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            pytest.fail(f"waited {timeout:g} s for {what}\n{logs()}")
        time.sleep(0.2)
