"""Checkpoint save and load time and size for the GPT example's model, at 2 and 4 ranks.

    .venv/bin/python -m benchmarks.checkpoint_io                      # the demo's GPT (6 blocks, d=64)
    .venv/bin/python -m benchmarks.checkpoint_io --d-model 256 --layers 8 --repeats 3

One torchrun job per rank count (gloo, one thread per process) builds the
GPT of ``examples/gpt_stdlib.py`` as a 1F1B pipeline with per-stage AdamW,
trains one step (so the optimizer state exists), then times, barrier to
barrier, ``sw.checkpoint.save`` and ``sw.checkpoint.load`` (which verifies
every file's SHA-256 first), and, for comparison, bare DCP ``save``/``load``
of the same tensors (no manifest, no hashing, no name checks, no RNG or JSON
record). Reported: the median over ``--repeats`` and the checkpoint's size on
disk.
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

from ._examples import example
from ._launch import environ, torchrun


def same_tensors(pipe: Any) -> dict[str, Any]:
    """What ``sw.checkpoint.save`` writes of this rank, as one flat dict for bare DCP: the model's state and every
    tensor of the optimizers' state (DCP alone: no manifest, no hashing, no name checks)."""
    import torch

    out = {f"model/{k}": v for k, v in pipe.state_dict().items()}
    names = {id(p): name for name, p in pipe.named_parameters()}  # the one-process names, as the checkpoint's
    for opt in pipe.optimizers.values():
        for p, state in opt.state.items():
            tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
            out.update({f"optim/{names[id(p)]}/{k}": v for k, v in tensors.items()})
    return out


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import stagewise as sw

    gpt = example("gpt_model")
    GPTConfig, gpt_layers, lm_loss = gpt.GPTConfig, gpt.gpt_layers, gpt.lm_loss
    torch.set_num_threads(1)
    sw.init()
    cfg = GPTConfig(d_model=args.d_model, n_layers=args.layers, n_heads=4, seq_len=64)
    pipe = sw.Pipeline(
        gpt_layers(cfg),
        loss_fn=lm_loss,
        schedule="1f1b",
        microbatches=8,
        partition="parameters",
        optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
    )
    x = torch.randint(0, 256, (16, 65), generator=torch.Generator().manual_seed(0))
    pipe.train_step(x[:, :-1], x[:, 1:])
    root = Path(args.root)
    times: dict[str, list[float]] = {"save": [], "load": [], "dcp_save": [], "dcp_load": []}

    def timed(key: str, fn) -> None:  # type: ignore[no-untyped-def]
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        times[key].append(time.perf_counter() - t0)

    raw = same_tensors(pipe)
    for i in range(args.repeats):
        timed("save", lambda i=i: sw.checkpoint.save(root / "sw", pipe, step=i, keep=1))
        timed("load", lambda: sw.checkpoint.load(root / "sw", pipe))
        timed("dcp_save", lambda i=i: dcp.save(raw, checkpoint_id=str(root / "dcp" / str(i))))
        timed("dcp_load", lambda i=i: dcp.load(raw, checkpoint_id=str(root / "dcp" / str(i))))
    if dist.get_rank() == 0:
        folder = sw.checkpoint.latest(root / "sw")
        size = sum(p.stat().st_size for p in folder.iterdir())
        out = {k: statistics.median(v) for k, v in times.items()}
        out.update(bytes=size, files=len(list(folder.iterdir())))
        Path(args.result).write_text(json.dumps(out))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--root", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    rows = []
    for n in args.ranks:
        with tempfile.TemporaryDirectory() as tmp:
            result = Path(tmp) / "result.json"
            flags = ["--worker", f"--root={tmp}", f"--result={result}", f"--repeats={args.repeats}"]
            flags += [f"--d-model={args.d_model}", f"--layers={args.layers}"]
            cmd = torchrun(n, "benchmarks.checkpoint_io", flags)
            env = environ(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
            done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
            if done.returncode != 0:
                raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
            rows.append((n, json.loads(result.read_text())))
    print(f"GPT d={args.d_model} x {args.layers} blocks, 1f1b, per-stage AdamW; median of {args.repeats}")
    print(f"load average {os.getloadavg()[0]:.1f}")
    print("| ranks | size MiB | files | save ms | load ms | bare DCP save ms | bare DCP load ms |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for n, r in rows:
        print(
            f"| {n} | {r['bytes'] / 2**20:.2f} | {r['files']} | {r['save'] * 1e3:.0f} | {r['load'] * 1e3:.0f} "
            f"| {r['dcp_save'] * 1e3:.0f} | {r['dcp_load'] * 1e3:.0f} |"
        )


if __name__ == "__main__":
    main()
