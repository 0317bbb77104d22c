"""A few float64 training steps at pp=4 over however many machines torchrun joined (tests/system/test_multinode.py).

    PYTHONPATH=tests stagewise run -n 2 --nnodes 2 --node-rank I --rdzv-endpoint HOST:PORT \
        tests/system/scripts/multinode_train.py --out DIR

Writes ``DIR/rank-R.json`` (the transport the pipeline chose, the host name
and network namespace it ran in, the losses) and the final checkpoint under
``DIR/ckpt``, which the test loads into the one-process model to compare.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

import stagewise as sw
from helpers import models as mdl

SEED = 3
STEPS = 3
BATCH = 8


def layers() -> list[sw.Layer]:
    return mdl.lm(2)


def adamw(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    env = sw.init(timeout=60)
    pipe = sw.Pipeline(layers(), loss_fn=mdl.lm_loss, schedule="1f1b", microbatches=4, seed=SEED, optimizer=adamw)
    losses = []
    for step in range(STEPS):
        x, y = mdl.lm_data(BATCH, seed=100 + step)
        losses.append(pipe.train_step(x, y))
    sw.checkpoint.save(args.out / "ckpt", pipe, step=STEPS, extra={"losses": losses})
    row = {
        "transport": type(pipe.transport).__name__,
        "netns": os.readlink("/proc/self/ns/net"),
        "world": env.world_size,
        "losses": losses,
    }
    (args.out / f"rank-{env.rank}.json").write_text(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
