"""The held-out calibration benchmark across namespace machines, the link shaped by ``tc`` (issue 49 item 2).

Two machines (Linux network namespaces on a bridge, :mod:`helpers.netns` of the tests, made and deleted here;
root) each run one torchrun node of the worker (:mod:`.worker`, gloo on its veth), ``world / 2`` processes
each; every machine's veth shapes what it sends by a qdisc of :data:`LINKS` (the axis, fixed before its first
run): ``netem delay D`` (a message between machines waits ``D`` once, a round trip ``2 D``), or ``tbf rate R``
(the link's bandwidth). A kernel without ``sch_netem`` (``CONFIG_NET_SCH_NETEM`` unset: "Specified qdisc kind
is unknown", as on this VM) gets the same delay from :mod:`.delay_line` instead: every packet a machine receives
from its veth is held ``D`` in userspace (an iptables NFQUEUE rule; Debian's ``iptables``), on veths of MTU
:data:`DELAY_MTU` (a packet per message rather than per 1.5 KB, so the line's CPU stays near 2 % of a core);
the job's result says which shaped its link (``"shaped_by"``) and what the line cost. Per link the worker
calibrates on plan P over it and predicts the plans Q. Needs root.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .._launch import ROOT, with_the_tests

#: the link axis: a qdisc and its parameters on each machine's veth ("": none)
LINKS = ("", "netem delay 2ms", "netem delay 10ms", "tbf rate 100mbit burst 32kbit latency 400ms",
         "tbf rate 20mbit burst 32kbit latency 400ms")  # fmt: skip


#: the veths' MTU where :mod:`.delay_line` holds the packets (what loopback has; tbf's burst rules it out there)
DELAY_MTU = 65000


def shape(machine: str, veth: str, link: str) -> str | None:
    """The qdisc ``link`` on a machine's veth; None when done, else why it cannot be (the kernel lacks it)."""
    if not link:
        return None
    done = subprocess.run(["ip", "netns", "exec", machine, "tc", "qdisc", "add", "dev", veth, "root", *link.split()],
                          capture_output=True, text=True, timeout=30)  # fmt: skip
    return None if done.returncode == 0 else f"tc qdisc add ... {link}: {done.stderr.strip()}"


def delay_of(link: str) -> float | None:
    """The seconds of a ``netem delay D`` link (None for any other link)."""
    m = re.fullmatch(r"netem delay ([0-9.]+)(us|ms|s)", link)
    return None if m is None else float(m.group(1)) * {"us": 1e-6, "ms": 1e-3, "s": 1.0}[m.group(2)]


@contextmanager
def shaped(machines: Any, link: str, logs: Path, mtu: int | None = None) -> Iterator[dict[str, Any] | None]:
    """Every machine's veth shaped by ``link``: by ``tc``, or a ``netem delay`` the kernel lacks by
    :mod:`.delay_line`; yields what shaped it (filled with the lines' packets and CPU when they stop), None
    where it cannot be. ``mtu``: every veth's, whatever shapes it (a delay line's is :data:`DELAY_MTU`)."""
    how: dict[str, Any] = {"by": "tc" if link else "nothing", **({"mtu": mtu} if mtu else {})}
    lines: list[subprocess.Popen[bytes]] = []
    started = time.monotonic()
    if mtu and mtu > 1500 and link.startswith("tbf"):  # (its burst, 4 KB here, must hold a whole packet)
        print(f"link {link!r} skipped: --mtu {mtu} is over the burst of the link's tbf, which would drop every "
              "packet", file=sys.stderr)  # fmt: skip
        yield None
        return
    try:
        for i in range(machines.n):
            if mtu:
                _set_mtu(machines, i, mtu)
            why = shape(machines.name(i), f"{machines.tag}v{i}", link)
            if why is None:
                continue
            delay, iptables = delay_of(link), shutil.which("iptables-legacy") or shutil.which("iptables")
            if delay is None or "unknown" not in why or iptables is None:
                print(f"link {link!r} skipped: {why}" + ("" if iptables else " (no iptables for the delay line: "
                      "apt-get install iptables)"), file=sys.stderr)  # fmt: skip
                yield None
                return
            lines.append(_delay_line(machines, i, delay, iptables, logs / f"line{i}.log"))
            how = {"by": "delay line (NFQUEUE on each machine's input, benchmarks/calibration/delay_line.py)",
                   "mtu": DELAY_MTU}  # fmt: skip
        yield how
    finally:
        for line in lines:
            line.terminate()
            line.wait(timeout=30)
        if lines:
            held = [_held(logs / f"line{i}.log") for i in range(len(lines))]
            how["packets"], how["cpu_s"] = sum(h[0] for h in held), sum(h[1] for h in held)
            how["wall_s"] = time.monotonic() - started


def _delay_line(machines: Any, i: int, delay: float, iptables: str, log: Path) -> subprocess.Popen[bytes]:
    """Machine ``i``'s line: its veth (and the switch's end, and the bridge) at :data:`DELAY_MTU`, the line
    bound to its queue, then the rule that sends it what arrives on the veth."""
    name, veth = machines.name(i), f"{machines.tag}v{i}"
    _set_mtu(machines, i, DELAY_MTU)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = open(log, "wb")  # noqa: SIM115 (the line's own file: read after it stops)
    line = subprocess.Popen(["ip", "netns", "exec", name, sys.executable, "-m", "benchmarks.calibration.delay_line",
                             "--queue", "0", "--delay", repr(delay), "--stats"], stdout=out, stderr=out, cwd=ROOT,
                            env=env)  # fmt: skip
    out.close()
    for _ in range(100):
        if "ready" in log.read_text() or line.poll() is not None:
            break
        time.sleep(0.05)
    if "ready" not in log.read_text():
        line.kill()
        raise RuntimeError(f"the delay line of {name} did not start: {log.read_text()[-2000:]}")
    subprocess.run(["ip", "netns", "exec", name, iptables, "-A", "INPUT", "-i", veth, "-j", "NFQUEUE",
                    "--queue-num", "0"], check=True, timeout=30)  # fmt: skip
    return line


def _set_mtu(machines: Any, i: int, mtu: int) -> None:
    """Machine ``i``'s veth, the switch's end of it and the bridge at ``mtu``."""
    name, veth, port, switch = machines.name(i), f"{machines.tag}v{i}", f"{machines.tag}p{i}", f"{machines.tag}sw"
    for ns, dev in ((name, veth), (switch, port), (switch, "br0")):
        subprocess.run(["ip", "-n", ns, "link", "set", "dev", dev, "mtu", str(mtu)], check=True, timeout=30)


def _held(log: Path) -> tuple[int, float]:
    """The packets a line held and its CPU seconds, from its last line."""
    m = re.search(r"(\d+) packets held .* CPU ([0-9.]+) s", log.read_text())
    return (int(m.group(1)), float(m.group(2))) if m else (0, 0.0)


def job(
    link: str, world: int, worker_args: list[str], out: Path, port: int, mtu: int | None = None
) -> dict[str, Any] | None:
    """One job of ``world`` processes over 2 machines joined by ``link``; the worker's result (None on failure
    or where the kernel lacks the qdisc)."""
    with_the_tests("benchmarks.calibration", "elastic_harness")
    from helpers import netns  # the tests' machines: namespaces on a bridge, always deleted

    per = world // 2
    with (
        netns.make(f"cn{os.getpid() % 1000}", 2, subnet=211) as machines,
        tempfile.TemporaryDirectory() as tmp,
        shaped(machines, link, Path(tmp), mtu) as how,
    ):
        if how is None:
            return None
        procs = []
        for i in range(2):
            env = {"PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src")]), "OMP_NUM_THREADS": "1",
                   "GLOO_SOCKET_IFNAME": f"{machines.tag}v{i}", "PYTHONWARNINGS": "ignore"}  # fmt: skip
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(i),
                   "--nproc-per-node", str(per), "--master-addr", machines.addr(0), "--master-port", str(port),
                   "-m", "benchmarks.calibration.worker", *worker_args, "--out", str(out)]  # fmt: skip
            if "--pin" in worker_args:  # a machine per core (its one rank pins within it): not both on core 0
                cmd = ["taskset", "-c", str(sorted(os.sched_getaffinity(0))[i]), *cmd]
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
    line = " (delay line)" if "cpu_s" in how else ""
    result["link"] = (link or "veth") + line + (f", MTU {how['mtu']}" if mtu and "mtu" in how else "")
    result["shaped_by"] = how
    if "cpu_s" in how:
        print(f"link {link!r}: the delay lines held {how['packets']} packets on {how['cpu_s']:.2f} s of CPU in "
              f"{how['wall_s']:.0f} s of the job", file=sys.stderr)  # fmt: skip
    return result
