"""A small elastic job for machines on one host (tests/system/test_elastic_local.py): no root, no namespaces.

Each "machine" is one ``stagewise run -n 1 --nnodes MIN:MAX`` on localhost with its own snapshot folder
(``STAGEWISE_SNAPSHOT_DIR``); ``sw.ElasticLayout(pp=1, batch=12, microbatch_size=2)``: data parallelism over
every process, snapshots every 2 steps. Options:

* ``--fail STEP``: on the first attempt, rank 1 raises at STEP (its snapshot of STEP - 1 copied): a restart;
* ``--hold STEP``: at STEP (full size), every rank leaves ``hold-r<R>`` and waits for ``go``: the test loses a
  machine meanwhile;
* ``--refuse``: every rank raises ``ValueError`` before its first step (a script that cannot run at all);
* ``--keep-copy DIR``: at step 4, after its snapshot is copied, rank 0 copies its machine's snapshot files
  into DIR (what a machine lost at that step would still hold afterwards).

Writes ``attempts/<attempt>-r<rank>`` at each start and ``losses.jsonl`` (rank 0: step, loss, world).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import stagewise as sw

LAYOUT = sw.ElasticLayout(pp=1, batch=12, microbatch_size=2)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--fail", type=int, default=0)
    p.add_argument("--hold", type=int, default=0)
    p.add_argument("--refuse", action="store_true")
    p.add_argument("--keep-copy", type=Path, default=None)
    args = p.parse_args()
    env = sw.init(timeout=20)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    (args.out / "attempts").mkdir(parents=True, exist_ok=True)
    (args.out / "attempts" / f"{attempt}-r{env.rank}").touch()
    if args.refuse:
        raise ValueError("this script refuses to run (a refusal every rank raises before its first step)")
    fit = LAYOUT.at(env)
    layers = [sw.Layer(nn.Linear, 6, 16), sw.Layer(nn.ReLU), sw.Layer(nn.Linear, 16, 3)]
    pipe = sw.Pipeline(
        layers, loss_fn=F.cross_entropy, parallel=fit.parallel, microbatches=fit.microbatches, seed=3,
        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.05), snapshot=2, timeout=20,
    )  # fmt: skip
    info = sw.checkpoint.resume(args.out / "ckpt", pipe)
    start = 0 if info is None else info.step
    data = torch.randn(12 * args.steps, 6, generator=torch.Generator().manual_seed(0))
    for step in range(start + 1, args.steps + 1):
        rows = slice(12 * (step - 1), 12 * step)
        if args.fail == step and attempt == "0" and env.rank == 1:
            pipe.snapshots.wait()  # the snapshot of the step before is whole everywhere
            raise RuntimeError(f"planned failure at step {step}")
        loss = pipe.train_step(*pipe.local_batch(data[rows], data[rows, :3].argmax(1)))
        if env.rank == 0:
            with open(args.out / "losses.jsonl", "a") as f:
                f.write(json.dumps({"step": step, "loss": loss, "world": env.world_size, "t": time.time()}) + "\n")
        if step == 4 and args.keep_copy is not None and env.rank == 0:
            keep(pipe, args.keep_copy)
        if step == args.hold and env.world_size == max(env.world_sizes):
            pipe.snapshots.wait()
            (args.out / f"hold-r{env.rank}").touch()
            while not (args.out / "go").exists():
                time.sleep(0.05)
    print(f"user print: rank {env.rank} finished at step {args.steps} on {env.world_size} processes", flush=True)
    return 0


def keep(pipe: sw.Pipeline, into: Path) -> None:
    """Rank 0's machine's whole snapshot files, copied aside."""
    assert pipe.snapshots is not None
    pipe.snapshots.wait()
    into.mkdir(parents=True, exist_ok=True)
    for path in pipe.snapshots.folder.glob("*.snap"):
        shutil.copy(path, into / path.name)


if __name__ == "__main__":
    raise SystemExit(main())
