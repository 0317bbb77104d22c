"""What a snapshot after every step costs a step, by workload: ``snapshot=1`` against none, A/B alternating.

One torchrun job of ``--ranks`` processes per workload (gloo, one thread each; at 2 processes each pinned to
a core of its own), each rank its own pretend machine up to ``--machines`` (torchrun's ``GROUP_RANK``, a
snapshot folder each under ``/dev/shm``), so every snapshot is also sent to a peer, as on real machines.
Two pipelines of the same model are built, one with ``snapshot=1`` and one without; rounds of ``--steps``
steps alternate between them (A B, then B A, ...) with ``--interval`` seconds of rest between rounds, so a
change of the machine's load hits both alike. Per workload: the state bytes per rank (what a snapshot
holds), the median step, state bytes / step time (the copy rate a snapshot after every step asks for), and
the overhead: per round pair, B's mean step over A's (the mean: a stall every few steps counts) minus 1;
its median over the pairs with a distribution-free 95 % interval for that median (order statistics of the
pairs: no assumption on their spread), and the lowest and highest pair.

``--commit`` chooses what B is (``Snapshots.commit``): ``pipelined`` (the default: ``train_step`` waits only
for the previous step's snapshot to be committed), ``sync`` (``train_step`` returns once its own snapshot is
committed), or both, each a pipeline of its own against the same A in rounds that rotate the order.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import tempfile
import threading
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

    def build(mode: str) -> Any:
        # each B its own folder (the other's prune would take its spares), by the environment: the same options
        os.environ["STAGEWISE_SNAPSHOT_DIR"] = str(Path(args.folder) / f"m{machine}-{mode}")
        return sw.Pipeline(
            gpt.gpt_layers(cfg),
            loss_fn=gpt.lm_loss,
            schedule="1f1b",
            microbatches=fit.microbatches,
            parallel=fit.parallel,
            optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
            snapshot=None if mode == "none" else sw.Snapshots(every=1, commit=mode),
        )  # fmt: skip

    pipes = {mode: build(mode) for mode in ("none", *args.commit)}
    step = 0

    modes = ["none", *args.commit]
    cpu = dict.fromkeys(modes, 0.0)  # this process's CPU seconds in the measured rounds, by mode
    threads: dict[str, dict[str, float]] = {m: {} for m in modes}  # and by thread (see thread_cpu)
    snap_gloo = {t for p in pipes.values() if p.snapshots is not None for t in p.snapshots.priority.group}

    def round_of(mode: str) -> tuple[float, float]:
        nonlocal step
        pipe, times = pipes[mode], []
        started, by_thread = time.process_time(), thread_cpu(snap_gloo)
        for _ in range(args.steps):
            step += 1
            g = torch.Generator().manual_seed(step)
            x = torch.randint(0, cfg.vocab_size, (spec["batch"], cfg.seq_len + 1), generator=g)
            dist.barrier()
            t0 = time.perf_counter()
            pipe.train_step(*pipe.local_batch(x[:, :-1], x[:, 1:]))  # (sync: returns with its step committed)
            times.append(time.perf_counter() - t0)
        if pipe.snapshots is not None:
            pipe.snapshots.wait()  # (its tail belongs to this round, not to the next one's)
        cpu[mode] += time.process_time() - started
        ended, found = time.process_time() - started, thread_cpu(snap_gloo)
        for kind, secs in found.items():
            threads[mode][kind] = threads[mode].get(kind, 0.0) + secs - by_thread.get(kind, 0.0)
        gone = ended - sum(found.values()) + sum(by_thread.values())  # (threads that ended in the round)
        threads[mode]["ended"] = threads[mode].get("ended", 0.0) + gone
        return statistics.median(times), statistics.fmean(times)

    for mode in modes:  # warm-up
        round_of(mode)
    cpu.update(dict.fromkeys(modes, 0.0))
    threads.update({m: {} for m in modes})
    snaps = {mode: pipes[mode].snapshots for mode in args.commit}
    for one in snaps.values():
        assert one is not None
        one.stats.update({k: 0.0 for k in one.stats})
    rounds: list[dict[str, tuple[float, float]]] = []
    for r in range(args.rounds):
        order = modes[r % len(modes) :] + modes[: r % len(modes)]  # each mode first, second, ... in turn
        got = {}
        for mode in order if r % 2 == 0 else order[::-1]:
            time.sleep(args.interval)
            got[mode] = round_of(mode)
        rounds.append(got)
    mine = f"*-r{rank:05d}.snap"
    state = sum(p.stat().st_size for p in snaps[args.commit[0]].folder.glob(mine)) // 2
    everyone: list[Any] = [None] * world
    steps = args.rounds * args.steps
    parts = {
        mode: {k: v / max(one.stats["snapshots"], 1) for k, v in one.stats.items() if k != "snapshots"}
        for mode, one in snaps.items()
    }
    extra_cpu = {m: (cpu[m] - cpu["none"]) / steps for m in args.commit}
    kinds = {k for got in threads.values() for k in got}
    extra_threads = {
        m: {k: (threads[m].get(k, 0.0) - threads["none"].get(k, 0.0)) / steps for k in sorted(kinds)}
        for m in args.commit
    }
    found = {"rounds": rounds, "bytes": state, "parts": parts, "extra_cpu": extra_cpu, "threads": extra_threads}
    dist.all_gather_object(everyone, found)
    if rank == 0:
        Path(args.result).write_text(json.dumps({"layout": fit.describe(), "ranks": everyone}))
    dist.destroy_process_group()


def thread_cpu(snap_gloo: set[int]) -> dict[str, float]:
    """This process's CPU seconds so far by kind of thread (Linux: each live thread's ``schedstat``, in ns): the
    training thread, the snapshots' gloo threads, the snapshots' own Python threads still running (the helper,
    the transfer and commit threads), the rest (the pipeline's gloo threads, ...). Threads that ended are not
    here: the caller counts them from the process's CPU ("ended": mostly a snapshot's threads, one set each)."""
    named = {t.native_id: t.name for t in threading.enumerate()}
    main = threading.main_thread().native_id
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else []:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                secs = int(f.read().split()[0]) / 1e9
        except (OSError, ValueError, IndexError):  # (ended meanwhile)
            continue
        kind = "training" if int(tid) == main else "snapshot gloo" if int(tid) in snap_gloo else "other"
        if named.get(int(tid), "").startswith("stagewise-snapshot"):
            kind = "snapshot threads"
        out[kind] = out.get(kind, 0.0) + secs
    return out


def median_interval(values: list[float], level: float = 0.95) -> tuple[float, float, float]:
    """A distribution-free interval for the median of ``values`` (their order statistics ``k`` from each end,
    ``k`` the most whose binomial coverage is still at least ``level``) and its coverage; with too few values
    for ``level``, the whole range and its own coverage."""
    xs, n = sorted(values), len(values)
    below = [math.comb(n, i) / 2**n for i in range(n + 1)]  # P(exactly i of n pairs below the median)
    k, tail = 0, 0.0
    while k < n // 2 and 1 - 2 * (tail + below[k]) >= level:
        tail += below[k]
        k += 1
    k = max(k, 1)
    return xs[k - 1], xs[n - k], 1 - 2 * sum(below[:k])


def row(model: str, ranks: int, found: dict[str, Any], mode: str) -> str:
    rounds = found["ranks"][0]["rounds"]  # every rank waited at the barrier: rank 0's clock times the job's step
    base = statistics.median(r["none"][0] for r in rounds)
    over = [100 * (r[mode][1] / r["none"][1] - 1) for r in rounds]  # the mean steps, pair by pair
    lo, hi, cover = median_interval(over)
    state = max(r["bytes"] for r in found["ranks"])
    rate = state / 2**20 / base
    return (
        f"| {model} | {ranks} | {found['layout']} | {mode} | {state / 2**20:.1f} | {1e3 * base:.1f} | {rate:.0f} "
        f"| {statistics.median(over):+.1f} % | {lo:+.1f} / {hi:+.1f} % ({100 * cover:.0f} %) "
        f"| {min(over):+.1f} / {max(over):+.1f} % | {len(over)} |"
    )


def breakdown(found: dict[str, Any]) -> str:
    """Per snapshot and rank: the helper thread's ms per part, wall (CPU), and the process's extra CPU per step."""
    out = []
    for r, got in enumerate(found["ranks"]):
        for mode, parts in got["parts"].items():
            cells = [
                f"{k[:-2]} {1e3 * parts[k]:.1f} ({1e3 * parts.get(k + '_cpu', 0.0):.1f})"
                for k in parts
                if k.endswith("_s") and parts[k]
            ]
            extra = 1e3 * got["extra_cpu"][mode]
            out.append(f"    rank {r}, {mode}: {', '.join(cells)}; extra CPU per step {extra:.1f} ms")
            by = ", ".join(f"{k} {1e3 * v:.1f}" for k, v in got.get("threads", {}).get(mode, {}).items())
            out.append(f"      extra CPU per step by thread (ms, against none): {by}")
    return "\n".join(out)


def main(args: argparse.Namespace) -> int:
    if args.worker:
        worker(args)
        return 0
    print(f"snapshot=1 ({', '.join(args.commit)}) against none, {args.rounds} rounds of {args.steps} steps each, "
          f"{args.interval:g} s apart")  # fmt: skip
    print(f"load average {os.getloadavg()[0]:.1f} (1 min) at the start; snapshot threads at {args.priority} priority")
    print("| workload | processes | layout | commit | state MiB/rank | step ms | state / step MiB/s | overhead "
          "(median of pairs) | 95 % interval of the median (coverage) | lowest / highest | pairs |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for ranks in args.ranks:
        for model in args.models:
            with tempfile.TemporaryDirectory(dir=args.folder_root) as tmp:
                result = Path(tmp) / "result.json"
                flags = ["snapshots", "--worker", f"--model={model}", f"--result={result}", f"--folder={tmp}"]
                flags += [f"--steps={args.steps}", f"--rounds={args.rounds}", f"--interval={args.interval}"]
                flags += ["--commit", *args.commit]
                flags += [f"--machines={min(ranks, 2)}"] + (["--pin"] if ranks == 2 else [])
                cmd = torchrun(ranks, "benchmarks.recovery", flags)
                idle = "0" if args.priority == "normal" else "1"
                env = environ(OMP_NUM_THREADS="1", STAGEWISE_SNAPSHOT_IDLE=idle)
                done = subprocess.run(cmd, capture_output=True, text=True, env=env)
                if done.returncode != 0:
                    raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
                found = json.loads(result.read_text())
                for mode in args.commit:
                    print(row(model, ranks, found, mode), flush=True)
                if args.breakdown:
                    print(breakdown(found), flush=True)
    print(f"load average {os.getloadavg()[0]:.1f} (1 min) at the end")
    return 0


def add(sub: Any) -> None:
    p = sub.add_parser("snapshots", help="snapshot=1 against none, A/B alternating, at 2 and 4 processes")
    p.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["demo", "d256"])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--steps", type=int, default=10, help="steps per round")
    p.add_argument("--rounds", type=int, default=12, help="rounds (each: A and every B, the order rotating)")
    p.add_argument("--commit", nargs="+", choices=["pipelined", "sync"], default=["pipelined"],
                   help="B: the library's pipelined commit, or train_step waiting for its own")  # fmt: skip
    p.add_argument("--interval", type=float, default=2.0, help="seconds of rest before each round")
    p.add_argument("--folder-root", default="/dev/shm", help="where the pretend machines' folders go")
    p.add_argument("--priority", choices=["idle", "normal"], default="idle", help="the snapshot threads' policy")
    p.add_argument("--breakdown", action="store_true",
                   help="per rank: ms per part of a snapshot, wall (CPU); extra CPU per step by thread")  # fmt: skip
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--pin", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--machines", type=int, default=2, help=argparse.SUPPRESS)
    p.add_argument("--model", default="demo", help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    p.add_argument("--folder", default=None, help=argparse.SUPPRESS)
