"""One model, the same processes, several 4-D layouts: step time and memory per rank.

    .venv/bin/python -m benchmarks.hybrid_layouts                       # 8 processes, the default layouts
    .venv/bin/python -m benchmarks.hybrid_layouts --layouts pp2-dp4 dp2-sharding4 --steps 5

A layout is written ``pp2-dp2-sharding1-tp2`` (missing axes are 1). One
torchrun job (gloo, one thread per process) trains the tensor-parallel GPT of
``examples/hybrid_tp_pp.py`` in every layout in turn: a warm-up step, then
timed steps of train_step + clip_grad_norm_ + AdamW step. Per layout:

* *step ms*: the median over the timed steps of the slowest rank (barrier to barrier);
* *params / grads / optimizer KiB*: the largest per-rank figure - the parameters a
  rank holds between steps (its shards), its gradients after train_step (sharded
  after SYNC under ``sharding``), and its AdamW state (exp_avg, exp_avg_sq);
* *state x*: the optimizer state per rank relative to the first layout's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ._examples import example
from ._launch import environ, torchrun

DEFAULT_LAYOUTS = (
    "dp8",
    "sharding8",
    "dp2-sharding4",
    "pp2-dp4",
    "pp4-dp2",
    "pp2-dp2-tp2",
    "pp2-sharding2-tp2",
    "dp2-tp4",
)


def parse_layout(text: str, world: int):  # -> sw.ParallelConfig
    import stagewise as sw
    from stagewise.parallel import AXES

    degrees = {}
    for part in text.split("-"):
        axis = part.rstrip("0123456789")
        if axis not in AXES or axis == part:
            raise SystemExit(f"bad layout part {part!r} in {text!r}: write e.g. pp2-dp2-sharding1-tp2")
        degrees[axis] = int(part[len(axis) :])
    config = sw.ParallelConfig(**degrees)
    config.check_world(world)
    return config


def _bytes(tensors) -> int:  # type: ignore[no-untyped-def]
    """Bytes this rank holds of ``tensors``: a DTensor's local shard (tensor parallel, sharded), else the tensor."""
    from torch.distributed.tensor import DTensor

    return sum((t.to_local() if isinstance(t, DTensor) else t).numel() * t.element_size() for t in tensors)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import stagewise as sw

    tp = example("hybrid_tp_pp")
    GPTConfig, lm_loss, random_walk, tp_gpt_layers, tp_plan = (
        tp.GPTConfig, tp.lm_loss, tp.random_walk, tp.tp_gpt_layers, tp.tp_plan
    )  # fmt: skip

    torch.set_num_threads(1)
    env = sw.init(backend="gloo")
    cfg = GPTConfig(vocab_size=256, seq_len=32, d_model=args.d_model, n_heads=4, n_layers=args.layers)
    rows = []
    for text in args.layouts:
        config = parse_layout(text, env.world_size)
        pipe = sw.Pipeline(
            tp_gpt_layers(cfg),
            loss_fn=lm_loss,
            schedule=args.schedule,
            microbatches=args.microbatches,
            parallel=config,
            tp_plan=tp_plan(),
        )
        opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
        times, grad_bytes = [], 0
        for step in range(1 + args.steps):
            x, y = random_walk(args.batch_size, cfg, step)
            x, y = pipe.local_batch(x, y)
            dist.barrier()
            t0 = time.perf_counter()
            pipe.train_step(x, y)
            grad_bytes = _bytes(p.grad for p in pipe.parameters() if p.grad is not None)
            pipe.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()
            dist.barrier()
            if step:
                times.append(time.perf_counter() - t0)
        state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
        mine = {
            "step_s": statistics.median(times),
            "params": _bytes(pipe.parameters()),
            "grads": grad_bytes,
            "state": _bytes(state),
        }
        everyone = [None] * env.world_size
        dist.all_gather_object(everyone, mine)
        rows.append({"layout": text, "ranks": everyone})
        del pipe, opt
    if env.rank == 0:
        Path(args.out).write_text(json.dumps(rows))
    dist.barrier()


def table(rows: list[dict]) -> str:
    head = "| layout | step ms | params KiB/rank | grads KiB/rank | optimizer KiB/rank | state x |"
    lines = [head, "|---|---:|---:|---:|---:|---:|"]
    base = None
    for row in rows:
        ranks = row["ranks"]
        worst = {k: max(r[k] for r in ranks) for k in ("params", "grads", "state")}
        base = base or worst["state"]
        step_ms = 1000 * max(r["step_s"] for r in ranks)
        lines.append(
            f"| {row['layout']} | {step_ms:.0f} | {worst['params'] / 1024:.1f} | {worst['grads'] / 1024:.1f} "
            f"| {worst['state'] / 1024:.1f} | {worst['state'] / base:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--layouts", nargs="+", default=list(DEFAULT_LAYOUTS))
    parser.add_argument("--steps", type=int, default=3, help="timed steps per layout (after one warm-up)")
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    for text in args.layouts:
        parse_layout(text, args.ranks)  # fail early, before starting processes
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        flags = ["--worker", "--out", str(out), "--layouts", *args.layouts]
        for flag in ("steps", "schedule", "microbatches", "batch_size", "layers", "d_model"):
            flags += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
        cmd = torchrun(args.ranks, "benchmarks.hybrid_layouts", flags)
        env = environ(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        started = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0 or not out.exists():
            sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
            raise SystemExit(f"the benchmark job failed (exit {proc.returncode})")
        rows = json.loads(out.read_text())
    print(
        f"{args.ranks} gloo processes, GPT d_model={args.d_model} x {args.layers} blocks, "
        f"batch {args.batch_size}, {args.schedule} with {args.microbatches} micro-batches "
        f"({time.perf_counter() - started:.0f} s in all)"
    )
    print(table(rows))


if __name__ == "__main__":
    main()
