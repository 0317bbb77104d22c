"""The demo GPT pipelined over 2 processes against one process on the same 2 cores: where does pipelining pay?

    .venv/bin/python -m benchmarks.vs_one_process                      # the demo's GPT (d_model 64)
    .venv/bin/python -m benchmarks.vs_one_process --d-model 256 --steps 20

Every row trains the same model (``examples/gpt_model.py``), data, batch and
AdamW for ``--steps`` timed steps after ``--warmup`` untimed ones, in a fresh
process (or a fresh 2-process torchrun job), one after another:

* *one process, 2 threads*: the comparison a CPU user makes first;
* *one process, 1 thread*: what one of the pipeline's cores does alone;
* *one process, 1 thread, m micro-batches*: the same step cut into m
  micro-batches with gradient accumulation - the cost of small GEMMs that
  every pipeline with m micro-batches pays, without any message or wait;
* *pipeline*, per schedule, micro-batch count and transport: 2 ranks, 1 thread each.

Columns: tokens/s (median step), the step time, and for the pipelines the
measured bubble (idle share of the ranks' time, from the runtime's own
timeline) and the CPU the busiest rank spends outside compute per step
(messages, bookkeeping). Ratios are against *one process, 2 threads* in the
same run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ._examples import example
from ._launch import environ, torchrun


def _model(args: argparse.Namespace):  # noqa: ANN202 - the example's types
    gpt = example("gpt_model")
    GPTConfig, gpt_layers, lm_loss = gpt.GPTConfig, gpt.gpt_layers, gpt.lm_loss
    cfg = GPTConfig(d_model=args.d_model, n_layers=args.layers, n_heads=args.heads, seq_len=args.seq_len)
    return gpt_layers(cfg), lm_loss


def _batches(args: argparse.Namespace, n: int) -> list[tuple[object, object]]:
    import torch

    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (n, args.batch_size, args.seq_len + 1), generator=g)
    return [(b[:, :-1], b[:, 1:]) for b in x]


def single(args: argparse.Namespace) -> dict[str, object]:
    """One process, ``args.threads`` threads, the step cut into ``args.microbatches`` (gradient accumulation)."""
    import torch

    import stagewise as sw

    torch.set_num_threads(args.threads)
    layers, loss_fn = _model(args)
    model = sw.build_model(layers, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    m = args.microbatches
    times, cpu = [], []
    for x, y in _batches(args, args.warmup + args.steps):
        t0, c0 = time.perf_counter(), time.process_time()
        for xs, ys in zip(x.chunk(m), y.chunk(m), strict=True):
            (loss_fn(model(xs), ys) / m).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return {"step": statistics.median(times[args.warmup :]), "cpu": statistics.median(cpu[args.warmup :])}


def pipeline(args: argparse.Namespace) -> None:
    """One rank of a 2-process job; rank 0 writes the medians to ``args.result``."""
    import torch
    import torch.distributed as dist

    import stagewise as sw

    torch.set_num_threads(1)
    sw.init()
    layers, loss_fn = _model(args)
    batches = _batches(args, args.warmup + args.steps)
    sample = batches[0][0][: args.batch_size // args.microbatches]  # one micro-batch, for partition="time"
    pipe = sw.Pipeline(
        layers,
        loss_fn=loss_fn,
        schedule=args.schedule,
        microbatches=args.microbatches,
        seed=0,
        transport=args.transport,
        partition=args.partition,
        sample_inputs=sample if args.partition in ("time", "memory") else None,
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
    )
    times, cpu, outside = [], [], []
    for x, y in batches:
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        pipe.train_step(x, y)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        outside.append(cpu[-1] - pipe.timeline().busy(pipe.rank))  # this rank's CPU not in compute actions
    bubble = pipe.timeline(gather=True).bubble_ratio  # the last step, every rank
    mine = torch.tensor([statistics.median(x[args.warmup :]) for x in (times, cpu, outside)])
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    if dist.get_rank() == 0:
        step, cpu_max, out_max = (max(float(t[k]) for t in everyone) for k in range(3))
        result = {"step": step, "cpu": cpu_max, "bubble": bubble, "outside": out_max}
        Path(args.result).write_text(json.dumps(result))
    dist.destroy_process_group()


def _flags(args: argparse.Namespace) -> list[str]:
    names = ("steps", "warmup", "d_model", "layers", "heads", "seq_len", "batch_size")
    return [x for n in names for x in (f"--{n.replace('_', '-')}", str(getattr(args, n)))]


def _run_single(args: argparse.Namespace, threads: int, m: int) -> dict[str, object]:
    cmd = [sys.executable, "-m", "benchmarks.vs_one_process", "--role", "single", "--threads", str(threads)]
    cmd += ["--microbatches", str(m)]
    out = subprocess.run(cmd + _flags(args), check=True, capture_output=True, text=True, env=_env(threads))
    return json.loads(out.stdout.strip().splitlines()[-1])


def _run_pipeline(args: argparse.Namespace, schedule: str, m: int, transport: str) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        flags = ["--role", "pipeline", "--schedule", schedule, "--microbatches", str(m), "--transport", transport]
        flags += ["--result", str(result), "--partition", args.partition]
        cmd = torchrun(2, "benchmarks.vs_one_process", flags + _flags(args))  # as `stagewise run -n 2` does
        done = subprocess.run(cmd, capture_output=True, text=True, env=_env(1))
        if done.returncode:
            return {"error": (done.stderr or done.stdout).strip().splitlines()[-1][:120]}
        return json.loads(result.read_text())


def _env(threads: int) -> dict[str, str]:
    return environ(OMP_NUM_THREADS=str(threads))


def _load() -> float:
    return os.getloadavg()[0]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--role", choices=("driver", "single", "pipeline"), default="driver")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--microbatches", type=int, default=1)
    p.add_argument("--schedule", default="1f1b")
    p.add_argument("--transport", default="auto")
    p.add_argument("--partition", default="uniform", help="the pipelines' partition mode (uniform, time, ...)")
    p.add_argument("--result", default="")
    p.add_argument("--schedules", nargs="+", default=["1f1b", "zb-v", "interleaved-1f1b"])
    p.add_argument("--counts", nargs="+", type=int, default=[2, 4, 8], help="micro-batch counts to try")
    p.add_argument("--transports", nargs="+", default=["shm", "torch"])
    args = p.parse_args(argv)
    if args.role == "single":
        print(json.dumps(single(args)))
        return
    if args.role == "pipeline":
        pipeline(args)
        return
    drive(args)


def drive(args: argparse.Namespace) -> None:
    tokens = args.batch_size * args.seq_len
    load0, t0 = _load(), time.perf_counter()
    rows: list[tuple[str, dict[str, object]]] = [
        ("one process, 2 threads", _run_single(args, 2, 1)),
        ("one process, 1 thread", _run_single(args, 1, 1)),
    ]
    rows += [(f"one process, 1 thread, {m} micro-batches", _run_single(args, 1, m)) for m in args.counts]
    for schedule in args.schedules:
        for m in args.counts:
            for transport in args.transports:
                rows.append((f"pipeline 2 ranks, {schedule}, {m} micro-batches, {transport}", None))  # type: ignore[arg-type]
                rows[-1] = (rows[-1][0], _run_pipeline(args, schedule, m, transport))
    base = float(rows[0][1]["step"])  # type: ignore[arg-type]
    print(
        f"\n{platform.processor() or platform.machine()}, {os.cpu_count()} cores; load average "
        f"{load0:.2f} before, {_load():.2f} after; {time.perf_counter() - t0:.0f} s; GPT d_model {args.d_model}, "
        f"{args.layers} blocks, batch {args.batch_size} x {args.seq_len} tokens; median of {args.steps} steps; "
        f"pipelines partitioned {args.partition!r}\n"
    )
    print("| run | tokens/s | step ms | vs 1 process, 2 threads | CPU ms (busiest) | bubble | CPU outside compute ms |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, r in rows:
        if "error" in r:
            print(f"| {name} | failed: {r['error']} | | | | | |")
            continue
        step = float(r["step"])  # type: ignore[arg-type]
        bubble = f"{float(r['bubble']):.0%}" if "bubble" in r else ""  # type: ignore[arg-type]
        outside = f"{float(r['outside']) * 1e3:.1f}" if "outside" in r else ""  # type: ignore[arg-type]
        print(
            f"| {name} | {tokens / step:,.0f} | {step * 1e3:.1f} | {base / step:.2f}x | "
            f"{float(r['cpu']) * 1e3:.1f} | {bubble} | {outside} |"  # type: ignore[arg-type]
        )


if __name__ == "__main__":
    main()
