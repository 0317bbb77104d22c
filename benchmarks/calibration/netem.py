"""The held-out calibration benchmark across namespace machines with ``tc netem`` link latency (issue 49 item 2).

Two machines (Linux network namespaces on a bridge, :mod:`helpers.netns` of the tests, made and deleted here;
root) each run one torchrun node of the worker (:mod:`.worker`, gloo on its veth), ``world / 2`` processes
each; every machine's veth delays what it sends by the latency (``tc qdisc add dev VETH root netem delay D``),
so a message between machines waits ``D`` once and a round trip ``2 D``. Per latency of :data:`LATENCIES_MS`
(the axis, fixed before its first run) the worker calibrates on plan P under that latency and predicts the
plans Q. Needs root.
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

#: the link latency axis, milliseconds one way (netem delay on each machine's veth)
LATENCIES_MS = (0.0, 2.0, 10.0)


def netem(machine: str, veth: str, delay_ms: float) -> None:
    """``tc netem`` delay on a machine's veth (none at 0)."""
    if delay_ms > 0:
        subprocess.run(["ip", "netns", "exec", machine, "tc", "qdisc", "add", "dev", veth, "root", "netem",
                        "delay", f"{delay_ms}ms"], check=True, capture_output=True, timeout=30)  # fmt: skip


def job(latency_ms: float, world: int, worker_args: list[str], out: Path, port: int) -> dict[str, Any] | None:
    """One job of ``world`` processes over 2 machines at ``latency_ms``; the worker's result (None on failure)."""
    with_the_tests("benchmarks.calibration", "elastic_harness")
    from helpers import netns  # the tests' machines: namespaces on a bridge, always deleted

    per = world // 2
    with netns.make(f"cn{os.getpid() % 1000}", 2, subnet=211) as machines, tempfile.TemporaryDirectory() as tmp:
        procs = []
        for i in range(2):
            netem(machines.name(i), f"{machines.tag}v{i}", latency_ms)
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
            print(f"latency {latency_ms} ms: the machines exited {codes}\n{tails}", file=sys.stderr)
            return None
    result: dict[str, Any] = json.loads(out.read_text())
    result["latency_ms"] = latency_ms
    return result
