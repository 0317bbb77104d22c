"""A training loop that runs until it is interrupted, for the Ctrl-C test of ``stagewise run``.

    stagewise run -n 2 tests/system/scripts/interrupt_train.py --out DIR

Every rank trains a small MLP on two ranks (1F1B, the shm transport where the host has it) step after step,
saves a checkpoint every ``--save-every`` steps (``DIR/ckpt/step-N``), and rank 0 writes the number of steps
finished to ``DIR/progress`` after each one, so that the test knows when to press Ctrl-C. Rank 0 writes its
transport's /dev/shm prefix to ``DIR/shm-prefix`` first: what must be gone once the job has stopped.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import stagewise as sw


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--save-every", type=int, default=3)
    args = parser.parse_args()
    env = sw.init(timeout=60)
    layers = [nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2)]
    pipe = sw.Pipeline(layers, loss_fn=F.cross_entropy, schedule="1f1b", microbatches=4, seed=0)
    if env.rank == 0:
        prefix = getattr(getattr(pipe.transport, "channels", None), "prefix", "")
        (args.out / "shm-prefix").write_text(prefix)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 8, generator=g), torch.randint(0, 2, (8,), generator=g)
    step = 0
    while True:
        pipe.train_step(x, y)
        step += 1
        if step % args.save_every == 0:
            sw.checkpoint.save(args.out / "ckpt", pipe, step=step)
        if env.rank == 0:
            (args.out / "progress.tmp").write_text(str(step))
            (args.out / "progress.tmp").replace(args.out / "progress")
        time.sleep(0.01)


if __name__ == "__main__":
    main()
