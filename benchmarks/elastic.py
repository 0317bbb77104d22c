"""Elastic jobs: what snapshots cost per step, and what a lost machine costs (time, steps).

    .venv/bin/python -m benchmarks.elastic cost                     # the demo GPT and a d 256 GPT, 4 ranks
    .venv/bin/python -m benchmarks.elastic cost --models d256 --every 1 10 --steps 40
    sudo .venv/bin/python -m benchmarks.elastic recovery            # 3 namespace machines (root), kill one

``cost``: one torchrun job of ``--ranks`` processes (gloo, one thread each) per model trains the GPT of
``examples/gpt_stdlib.py`` at ``sw.ElasticLayout(pp=2)`` (pp 2 x dp ranks/2, 1F1B, AdamW per stage),
the ranks split into ``--machines`` pretend machines (torchrun's ``GROUP_RANK`` set per rank, a snapshot
folder per machine under ``--folder``), so each snapshot is also sent to a peer. For ``snapshot=`` off and
every ``--every`` value it times ``--steps`` steps after ``--warmup`` (each train_step ends with every
rank holding the loss, so one rank's clock times the job's step) and prints the median step, the overhead
against no snapshots, and per snapshot: the synchronous part (buffers, generators, header), the wait of
the next optimizer step for the copy, the wait of the next snapshot for the previous one, and the bytes.

``recovery``: tests/system/scripts/elastic_train.py on three network-namespace machines of two processes
(``stagewise run --nnodes 2:3``, the tests' harness and rendezvous settings), machine 2 SIGKILLed at step
``--kill-at``; once with ``snapshot=--snapshot-every``, once with checkpoints only (every
``--save-every``). Printed: seconds from the kill to the first step on the survivors, steps lost (trained
again), and the whole job's wall time. Needs root (``ip netns``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ._examples import example
from ._launch import environ, torchrun, with_the_tests

MODELS = {"demo": {"d_model": 64, "n_layers": 6, "batch": 32}, "d256": {"d_model": 256, "n_layers": 8, "batch": 32}}


# ---- cost: the worker ------------------------------------------------------------------------------
def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import stagewise as sw

    gpt = example("gpt_model")
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    machine = rank * args.machines // world
    os.environ["GROUP_RANK"] = str(machine)  # what torchrun sets per machine: the peer copy crosses machines
    os.environ["STAGEWISE_SNAPSHOT_DIR"] = str(Path(args.folder) / f"m{machine}")
    env = sw.init()
    spec = MODELS[args.model]
    cfg = gpt.GPTConfig(d_model=spec["d_model"], n_layers=spec["n_layers"], n_heads=4, seq_len=64)
    fit = sw.ElasticLayout(pp=2, batch=spec["batch"], microbatches=4).at(env.world_size)
    rows = []
    for every in [0, *args.every]:
        pipe = sw.Pipeline(
            gpt.gpt_layers(cfg), loss_fn=gpt.lm_loss, schedule="1f1b", microbatches=fit.microbatches,
            parallel=fit.parallel, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
            snapshot=every or None,
        )  # fmt: skip
        times = []
        for step in range(args.warmup + args.steps):
            g = torch.Generator().manual_seed(step)
            x = torch.randint(0, cfg.vocab_size, (spec["batch"], cfg.seq_len + 1), generator=g)
            t0 = time.perf_counter()
            pipe.train_step(*pipe.local_batch(x[:, :-1], x[:, 1:]))
            if step >= args.warmup:
                times.append(time.perf_counter() - t0)
        row: dict[str, Any] = {"every": every, "step_ms": 1e3 * statistics.median(times)}
        if pipe.snapshots is not None:
            pipe.snapshots.wait()
            s = pipe.snapshots.stats
            if not s["snapshots"]:
                raise SystemExit(f"no snapshot of every {every} in {args.warmup + args.steps} steps: give more --steps")
            row.update({k: 1e3 * s[k] / s["snapshots"] for k in ("capture_s", "gate_s", "stall_s")})
            row["bytes"] = sum(p.stat().st_size for p in pipe.snapshots.folder.glob(f"*-r{rank:05d}.snap")) // 2
        rows.append(gather(row, dist))
    if rank == 0:
        Path(args.result).write_text(json.dumps({"layout": fit.describe(), "rows": rows}))
    dist.destroy_process_group()


def gather(row: dict[str, Any], dist: Any) -> dict[str, Any]:
    """Rank 0's step time; the snapshot costs' mean over the ranks, the bytes' largest."""
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, row)
    out = dict(everyone[0])
    for key in ("capture_s", "gate_s", "stall_s"):
        if key in out:
            out[key] = statistics.mean(r[key] for r in everyone)
    if "bytes" in out:
        out["bytes"] = max(r["bytes"] for r in everyone)
    return out


def cost(args: argparse.Namespace) -> None:
    print(f"{args.ranks} ranks as {args.machines} machines; median of {args.steps} steps after {args.warmup}")
    print(f"load average {os.getloadavg()[0]:.1f}")
    print(
        "| model | layout | snapshot | step ms | overhead | sync part ms | step waited ms | next waited ms | MiB/rank |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for model in args.models:
        with tempfile.TemporaryDirectory(dir=args.folder_root) as tmp:
            result = Path(tmp) / "result.json"
            flags = ["--worker", f"--model={model}", f"--result={result}", f"--folder={tmp}"]
            flags += [f"--steps={args.steps}", f"--warmup={args.warmup}", f"--machines={args.machines}"]
            flags += ["--every", *map(str, args.every)]
            cmd = torchrun(args.ranks, "benchmarks.elastic", ["cost", *flags])
            done = subprocess.run(cmd, capture_output=True, text=True, env=environ(OMP_NUM_THREADS="1"), timeout=3600)
            if done.returncode != 0:
                raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
            found = json.loads(result.read_text())
        base = found["rows"][0]["step_ms"]
        for r in found["rows"]:
            every = f"every {r['every']}" if r["every"] else "off"
            extra = " | ".join(f"{r[k]:.1f}" for k in ("capture_s", "gate_s", "stall_s")) if r["every"] else "- | - | -"
            mib = f"{r['bytes'] / 2**20:.1f}" if r["every"] else "-"
            over = f"{100 * (r['step_ms'] / base - 1):+.1f}%"
            print(f"| {model} | {found['layout']} | {every} | {r['step_ms']:.1f} | {over} | {extra} | {mib} |")


# ---- recovery: three namespace machines ----------------------------------------------------------
def recovery(args: argparse.Namespace) -> None:
    with_the_tests("benchmarks.elastic", "elastic_harness")
    from elastic_harness import Job
    from helpers import netns

    print(f"3 machines x 2 processes, machine 2 killed at step {args.kill_at}; load {os.getloadavg()[0]:.1f}")
    print("| snapshots | resumed from | steps lost | kill to first step s | job s |")
    print("|---|---|---|---|---|")
    for every in (args.snapshot_every, 0):
        with tempfile.TemporaryDirectory() as tmp, netns.make(f"be{os.getpid() % 1000}", 3, subnet=210) as machines:
            script = ["--steps", str(args.kill_at + 4), "--save-every", str(args.save_every), "--start-world", "6"]
            script += ["--holds", f"{args.kill_at}@6"]
            script += ["--every", str(every)] if every else ["--no-snapshots"]
            job = Job(machines, Path(tmp), script, port=29540)
            started = time.time()
            job.start(0, 1, 2)
            job.wait_markers(f"hold-{args.kill_at}-w6", 6, timeout=900)
            killed = job.lose(2)
            job.release(f"go-{args.kill_at}-w6")
            codes = job.exits([0, 1], timeout=900)
            if codes != [0, 0]:
                raise SystemExit(f"the survivors exited {codes}\n{job.tails()}")
            resumed = job.rows("resumes.jsonl")[-1]
            first = min(r["time"] for r in job.rows("losses.jsonl") if r["world"] == 4)
            label = f"every {every}" if every else f"off (checkpoint every {args.save_every})"
            lost = args.kill_at - resumed["step"]
            print(f"| {label} | {resumed['source']} step {resumed['step']} | {lost} | {first - killed:.1f} "
                  f"| {time.time() - started:.0f} |")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    c = sub.add_parser("cost", help="the per-step cost of snapshots (torchrun, one machine pretending to be several)")
    c.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["demo", "d256"])
    c.add_argument("--ranks", type=int, default=4)
    c.add_argument("--machines", type=int, default=2)
    c.add_argument("--every", type=int, nargs="+", default=[1, 10])
    c.add_argument("--steps", type=int, default=30)
    c.add_argument("--warmup", type=int, default=5)
    c.add_argument("--folder-root", default="/dev/shm", help="where the pretend machines' folders go")
    c.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    c.add_argument("--model", default="demo", help=argparse.SUPPRESS)
    c.add_argument("--result", default=None, help=argparse.SUPPRESS)
    c.add_argument("--folder", default=None, help=argparse.SUPPRESS)
    r = sub.add_parser("recovery", help="a machine lost: time to the first step, steps lost (root: ip netns)")
    r.add_argument("--kill-at", type=int, default=11)
    r.add_argument("--snapshot-every", type=int, default=2)
    r.add_argument("--save-every", type=int, default=8)
    args = p.parse_args()
    if args.what == "cost":
        worker(args) if args.worker else cost(args)
    else:
        recovery(args)


if __name__ == "__main__":
    sys.exit(main())
