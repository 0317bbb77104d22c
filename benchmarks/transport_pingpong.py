"""Time per message of each stagewise transport: a ping-pong between 2 ranks, through the Transport protocol.

    .venv/bin/python -m benchmarks.transport_pingpong [--rounds 2000] [--sizes 16 4096 65536 262144]

One torchrun job (gloo, 2 processes, one thread each). For each transport (``torch``: gloo point-to-point;
``shm``: shared memory) and message size, rank 0 posts its receive, sends, and waits for the reply; rank 1
echoes. Receives are posted before the peer sends, as the interpreter posts a step's receives at its start.
Reported: the median and 90th percentile of half a round trip (one message: post, copy, wake-up, wait,
through the same Python calls the engine makes), over blocks of 50 rounds; and the CPU time both processes
spent per message (all threads: gloo's I/O threads count), which background load changes far less; and
the CPU time of the shm protocol's Python path alone, in one process (send, ring, expect, complete).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from ._launch import environ, torchrun


def worker(rounds: int, sizes: list[int], out: Path) -> None:
    import torch
    import torch.distributed as dist

    import stagewise as sw
    from stagewise.runtime import shm_transport, torch_transport

    # the transports' door: the Transport protocol's values, for driving a transport directly as the engine does
    from stagewise.runtime.comm import Op, TransportSpec

    factories = {"torch": torch_transport, "shm": shm_transport}

    torch.set_num_threads(1)
    sw.init(backend="gloo")
    rank = dist.get_rank()
    peer = 1 - rank
    results: dict[str, dict[int, dict[str, list[float]]]] = {}
    for pid, kind in enumerate(("torch", "shm")):
        spec = TransportSpec(dist.group.WORLD, name=f"pingpong/{kind}", pipeline_id=900 + pid, timeout=60.0)
        tr = factories[kind](spec)
        results[kind] = {}
        for n, size in enumerate(sizes):
            ping, pong = 2 * n, 2 * n + 1  # tags of their own: the receive left posted at the end matches nothing
            mine, theirs = (pong, ping) if rank == 0 else (ping, pong)
            out_buf = torch.full((size // 4,), float(rank))
            in_buf = torch.empty(size // 4)
            dist.barrier()
            blocks: list[float] = []
            cpu: list[float] = []
            recv = tr.post([Op(peer, in_buf, send=False, tag=mine)])[0]
            for block in range(rounds // 50 + 2):  # the first two blocks warm up
                t0, c0 = time.perf_counter(), time.process_time()
                for _ in range(50):
                    if rank == 0:
                        sent = tr.post([Op(peer, out_buf, send=True, tag=theirs)])[0]
                    tr.wait(recv, "the other's message")
                    recv = tr.post([Op(peer, in_buf, send=False, tag=mine)])[0]
                    if rank == 1:
                        sent = tr.post([Op(peer, out_buf, send=True, tag=theirs)])[0]
                    tr.release(sent, "the send")
                if block >= 2:
                    blocks.append((time.perf_counter() - t0) / 100)  # 50 round trips = 100 messages
                    cpu.append((time.process_time() - c0) / 100)  # this process, all threads: its share
            both = torch.tensor(cpu, dtype=torch.float64)
            dist.all_reduce(both)  # both ends' CPU per message
            results[kind][size] = {"wall": blocks, "cpu": both.tolist()}
            dist.barrier()
        tr.close()
    if rank == 0:
        out.write_text(json.dumps(results))
    dist.barrier()
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2000)
    parser.add_argument("--sizes", type=int, nargs="+", default=[16, 4096, 32768, 262144], help="bytes")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.rounds, args.sizes, args.worker)
        return
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "pingpong.json"
        load0 = os.getloadavg()[0]
        flags = [f"--rounds={args.rounds}", "--sizes", *map(str, args.sizes), f"--worker={out}"]
        cmd = torchrun(2, "benchmarks.transport_pingpong", flags)
        env = environ(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        if not out.exists():
            raise SystemExit(f"ping-pong job failed (rc {proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
        results = json.loads(out.read_text())
        load1 = os.getloadavg()[0]
    print(f"load average {load0:.2f} before, {load1:.2f} after; {args.rounds} round trips per size\n")
    print("| bytes | gloo us/msg (median, p90) | shm us/msg (median, p90) | gloo / shm | CPU us/msg gloo | shm |")
    print("|---:|---:|---:|---:|---:|---:|")
    for size in args.sizes:
        g, s = results["torch"][str(size)], results["shm"][str(size)]
        gm, sm = statistics.median(g["wall"]), statistics.median(s["wall"])
        wall = f"{gm * 1e6:.0f} ({_p90(g['wall']) * 1e6:.0f}) | {sm * 1e6:.0f} ({_p90(s['wall']) * 1e6:.0f})"
        cpu = f"{statistics.median(g['cpu']) * 1e6:.0f} | {statistics.median(s['cpu']) * 1e6:.0f}"
        print(f"| {size} | {wall} | {gm / sm:.1f}x | {cpu} |")
    print(f"\nshm protocol's Python path alone (one process, 4096 bytes): {python_path() * 1e6:.1f} us/msg")


def python_path(n: int = 20000, size: int = 4096) -> float:
    """CPU seconds per message of the shm protocol's own Python path, in one process (no sleeping, no waking)."""
    import torch

    # internal: this times the shm protocol's own Python path, below the Transport protocol, which only the shm
    # transport's message streams (Channels) expose
    from stagewise.runtime.comm.shm.transport import SHM_DIR, Channels

    torch.set_num_threads(1)
    prefix = f"{SHM_DIR}/sw-bench-{os.getpid()}"
    a, b = Channels(prefix, 0, 2, lambda *_: None), Channels(prefix, 1, 2, lambda *_: None)
    out, into = torch.randn(size // 4), torch.empty(size // 4)
    c0 = time.process_time()
    for _ in range(n):
        a.send(1, 0, 0, out, "the value")
        a.ring(1)
        b.complete(b.expect(0, 0, 0, into), "the value")
    took = (time.process_time() - c0) / n
    a.close(everything=True)
    b.close(everything=True)
    return took


def _p90(xs: list[float]) -> float:
    return sorted(xs)[int(0.9 * (len(xs) - 1))]


if __name__ == "__main__":
    main()
