"""The held-out calibration benchmark across namespace machines, the link shaped by ``tc`` (issue 49 item 2).

Two machines (Linux network namespaces on a bridge, :mod:`helpers.netns` of the tests, made and deleted here;
root) each run one torchrun node of the worker (:mod:`.worker`, gloo on its veth), ``world / 2`` processes
each; every machine's veth shapes what it sends by a qdisc of :data:`LINKS` (the axis, fixed before its first
run): ``netem delay D`` (a message between machines waits ``D`` once, a round trip ``2 D``), or ``tbf rate R``
(the link's bandwidth). A kernel without a qdisc (``CONFIG_NET_SCH_NETEM`` unset: "Specified qdisc kind is
unknown") skips its links, saying so. Per link the worker calibrates on plan P over it and predicts the plans
Q. Needs root.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from .._launch import ROOT, with_the_tests

#: the link axis: a qdisc and its parameters on each machine's veth ("": none)
LINKS = ("", "netem delay 2ms", "netem delay 10ms", "tbf rate 100mbit burst 32kbit latency 400ms",
         "tbf rate 20mbit burst 32kbit latency 400ms")  # fmt: skip


def shape(machine: str, veth: str, link: str) -> str | None:
    """The qdisc ``link`` on a machine's veth; None when done, else why it cannot be (the kernel lacks it)."""
    if not link:
        return None
    done = subprocess.run(["ip", "netns", "exec", machine, "tc", "qdisc", "add", "dev", veth, "root", *link.split()],
                          capture_output=True, text=True, timeout=30)  # fmt: skip
    return None if done.returncode == 0 else f"tc qdisc add ... {link}: {done.stderr.strip()}"


def job(link: str, world: int, worker_args: list[str], out: Path, port: int) -> dict[str, Any] | None:
    """One job of ``world`` processes over 2 machines joined by ``link``; the worker's result (None on failure
    or where the kernel lacks the qdisc)."""
    with_the_tests("benchmarks.calibration", "elastic_harness")
    from helpers import netns  # the tests' machines: namespaces on a bridge, always deleted

    per = world // 2
    with netns.make(f"cn{os.getpid() % 1000}", 2, subnet=211) as machines, tempfile.TemporaryDirectory() as tmp:
        procs = []
        for i in range(2):
            why = shape(machines.name(i), f"{machines.tag}v{i}", link)
            if why is not None:
                print(f"link {link!r} skipped: {why}", file=sys.stderr)
                return None
            env = {"PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src")]), "OMP_NUM_THREADS": "1",
                   "GLOO_SOCKET_IFNAME": f"{machines.tag}v{i}", "PYTHONWARNINGS": "ignore"}  # fmt: skip
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(i),
                   "--nproc-per-node", str(per), "--master-addr", machines.addr(0), "--master-port", str(port),
                   "-m", "benchmarks.calibration.worker", *worker_args, "--out", str(out)]  # fmt: skip
            line = ["ip", "netns", "exec", machines.name(i), "env", *(f"{k}={v}" for k, v in env.items()), *cmd]
            log = open(Path(tmp) / f"m{i}.log", "wb")  # noqa: SIM115 (closed with the process)
            procs.append((subprocess.Popen(line, stdout=log, stderr=log, cwd=ROOT), log))
        codes = [p.wait(timeout=3600) for p, _ in procs]
        for _, log in procs:
            log.close()
        if codes != [0, 0] or not out.exists():
            tails = "\n".join((Path(tmp) / f"m{i}.log").read_text()[-3000:] for i in range(2))
            print(f"link {link!r}: the machines exited {codes}\n{tails}", file=sys.stderr)
            return None
    result: dict[str, Any] = json.loads(out.read_text())
    result["link"] = link or "veth"
    return result
