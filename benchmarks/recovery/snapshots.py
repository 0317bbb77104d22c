"""What a snapshot after every step costs a step, by workload: ``snapshot=1`` against none, A/B alternating.

One torchrun job of ``--ranks`` processes per workload (gloo, one thread each; at 2 processes each pinned to
a core of its own), each rank its own pretend machine up to ``--machines`` (torchrun's ``GROUP_RANK``, a
snapshot folder each under ``/dev/shm``), so every snapshot is also sent to a peer, as on real machines.
Two pipelines of the same model are built, one with ``snapshot=1`` and one without; rounds of ``--steps``
steps alternate between them (A B, then B A, ...) with ``--interval`` seconds of rest between rounds, so a
change of the machine's load hits both alike. Per workload: the state bytes per rank (what a snapshot
holds), the median step, state bytes / step time (the copy rate a snapshot after every step asks for), and
the overhead: the median over the round pairs of (B / A - 1), with its lowest and highest.
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
from typing import Any

from .._examples import example
from .._launch import environ, torchrun
from ..elastic import MODELS


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import stagewise as sw

    gpt = example("gpt_model")
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.pin and world <= len(os.sched_getaffinity(0)):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[rank]})  # one core each
    machine = rank * args.machines // world
    os.environ["GROUP_RANK"] = str(machine)  # as torchrun sets per machine: the copy crosses machines
    os.environ["STAGEWISE_SNAPSHOT_DIR"] = str(Path(args.folder) / f"m{machine}")
    env = sw.init()
    spec = MODELS[args.model]
    cfg = gpt.GPTConfig(d_model=spec["d_model"], n_layers=spec["n_layers"], n_heads=4, seq_len=64)
    fit = sw.ElasticLayout(pp=2, batch=spec["batch"], microbatches=4).at(env.world_size)
    pipes = {
        every: sw.Pipeline(
            gpt.gpt_layers(cfg),
            loss_fn=gpt.lm_loss,
            schedule="1f1b",
            microbatches=fit.microbatches,
            parallel=fit.parallel,
            optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
            snapshot=every or None,
        )  # fmt: skip
        for every in (0, 1)
    }
    step = 0

    cpu = {0: 0.0, 1: 0.0}  # this process's CPU seconds in the measured rounds, by pipeline

    def round_of(every: int) -> float:
        nonlocal step
        times = []
        started = time.process_time()
        for _ in range(args.steps):
            step += 1
            g = torch.Generator().manual_seed(step)
            x = torch.randint(0, cfg.vocab_size, (spec["batch"], cfg.seq_len + 1), generator=g)
            dist.barrier()
            t0 = time.perf_counter()
            pipes[every].train_step(*pipes[every].local_batch(x[:, :-1], x[:, 1:]))
            times.append(time.perf_counter() - t0)
        snaps = pipes[every].snapshots
        if snaps is not None:
            snaps.wait()  # (its tail belongs to this round, not to the next one's)
        cpu[every] += time.process_time() - started
        return statistics.median(times)

    for every in (0, 1):  # warm-up
        round_of(every)
    cpu.update({0: 0.0, 1: 0.0})
    assert pipes[1].snapshots is not None
    pipes[1].snapshots.stats.update({k: 0.0 for k in pipes[1].snapshots.stats})
    pairs = []
    for r in range(args.rounds):
        order = (0, 1) if r % 2 == 0 else (1, 0)
        got = {}
        for every in order:
            time.sleep(args.interval)
            got[every] = round_of(every)
        pairs.append((got[0], got[1]))
    snaps = pipes[1].snapshots
    assert snaps is not None
    state = sum(p.stat().st_size for p in snaps.folder.glob(f"*-r{rank:05d}.snap")) // 2
    everyone: list[Any] = [None] * world
    steps = args.rounds * args.steps
    parts = {k: v / max(snaps.stats["snapshots"], 1) for k, v in snaps.stats.items() if k != "snapshots"}
    extra_cpu = (cpu[1] - cpu[0]) / steps
    dist.all_gather_object(everyone, {"pairs": pairs, "bytes": state, "parts": parts, "extra_cpu": extra_cpu})
    if rank == 0:
        Path(args.result).write_text(json.dumps({"layout": fit.describe(), "ranks": everyone}))
    dist.destroy_process_group()


def row(model: str, ranks: int, found: dict[str, Any]) -> str:
    pairs = found["ranks"][0]["pairs"]  # every rank waited at the barrier: rank 0's clock times the job's step
    base = statistics.median(a for a, _ in pairs)
    over = [100 * (b / a - 1) for a, b in pairs]
    state = max(r["bytes"] for r in found["ranks"])
    rate = state / 2**20 / base
    return (
        f"| {model} | {ranks} | {found['layout']} | {state / 2**20:.1f} | {1e3 * base:.1f} | {rate:.0f} "
        f"| {statistics.median(over):+.1f} % | {min(over):+.1f} / {max(over):+.1f} % | {len(pairs)} |"
    )


def breakdown(found: dict[str, Any]) -> str:
    """Per snapshot and rank: the helper thread's ms per part, wall (CPU), and the process's extra CPU per step."""
    out = []
    for r, got in enumerate(found["ranks"]):
        parts = got["parts"]
        cells = [
            f"{k[:-2]} {1e3 * parts[k]:.1f} ({1e3 * parts.get(k + '_cpu', 0.0):.1f})" for k in parts if k.endswith("_s")
        ]
        out.append(f"    rank {r}: {', '.join(cells)}; extra CPU per step {1e3 * got['extra_cpu']:.1f} ms")
    return "\n".join(out)


def main(args: argparse.Namespace) -> int:
    if args.worker:
        worker(args)
        return 0
    print(f"snapshot=1 against none, {args.rounds} round pairs of {args.steps} steps, {args.interval:g} s apart")
    print(f"load average {os.getloadavg()[0]:.1f} (1 min) at the start; snapshot threads at {args.priority} priority")
    print("| workload | processes | layout | state MiB/rank | step ms | state / step MiB/s | overhead (median) "
          "| lowest / highest | pairs |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for ranks in args.ranks:
        for model in args.models:
            with tempfile.TemporaryDirectory(dir=args.folder_root) as tmp:
                result = Path(tmp) / "result.json"
                flags = ["snapshots", "--worker", f"--model={model}", f"--result={result}", f"--folder={tmp}"]
                flags += [f"--steps={args.steps}", f"--rounds={args.rounds}", f"--interval={args.interval}"]
                flags += [f"--machines={min(ranks, 2)}"] + (["--pin"] if ranks == 2 else [])
                cmd = torchrun(ranks, "benchmarks.recovery", flags)
                idle = "0" if args.priority == "normal" else "1"
                env = environ(OMP_NUM_THREADS="1", STAGEWISE_SNAPSHOT_IDLE=idle)
                done = subprocess.run(cmd, capture_output=True, text=True, env=env)
                if done.returncode != 0:
                    raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
                found = json.loads(result.read_text())
                print(row(model, ranks, found), flush=True)
                if args.breakdown:
                    print(breakdown(found), flush=True)
    print(f"load average {os.getloadavg()[0]:.1f} (1 min) at the end")
    return 0


def add(sub: Any) -> None:
    p = sub.add_parser("snapshots", help="snapshot=1 against none, A/B alternating, at 2 and 4 processes")
    p.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["demo", "d256"])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--steps", type=int, default=10, help="steps per round")
    p.add_argument("--rounds", type=int, default=6, help="round pairs (A B / B A)")
    p.add_argument("--interval", type=float, default=2.0, help="seconds of rest before each round")
    p.add_argument("--folder-root", default="/dev/shm", help="where the pretend machines' folders go")
    p.add_argument("--priority", choices=["idle", "normal"], default="idle", help="the snapshot threads' policy")
    p.add_argument("--breakdown", action="store_true", help="per rank: ms per part of a snapshot, wall (CPU)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--pin", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--machines", type=int, default=2, help=argparse.SUPPRESS)
    p.add_argument("--model", default="demo", help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    p.add_argument("--folder", default=None, help=argparse.SUPPRESS)
