"""A training script that kills one of its own ranks on chosen attempts, for ``stagewise run --max-restarts``.

    PYTHONPATH=tests stagewise run -n 2 --max-restarts 10 tests/system/scripts/restart_train.py --out DIR \
        --steps 12 --save-every 2 --kills 0:1:3:mid,1:0:4:before,...

Each kill is ``ATTEMPT:RANK:STEP:WHEN``: on restart attempt ATTEMPT
(``TORCHELASTIC_RESTART_COUNT``), rank RANK sends itself SIGKILL at step STEP,
WHEN being ``before`` (the step starts), ``mid`` (inside the step: in the
forward of its first stage, at the second micro-batch) or ``save`` (its share
of the step's checkpoint is written, the manifest not yet). Deterministic, so a
test can count the attempts. The model is the float64 LM of the checkpoint
checks with dropout (a resume is bit-exact only if the RNG comes back); batch
``s`` is drawn from seed ``100 + s``, so resuming at step ``s`` replays the data
position. Every attempt writes ``DIR/attempts/A-RANK`` when it starts. The last
step's checkpoint (``DIR/ckpt``) holds the parameters and, in ``extra``, every
step's loss: what the test compares with an uninterrupted run.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

import torch
from torch import nn

import stagewise as sw
from helpers import models as mdl
from stagewise.runtime.checkpoint import api

BATCH = 8


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class Tripwire(nn.Module):
    """Identity; SIGKILLs this process at the ``ARMED``-th forward of the step (the first and the last layer are
    tripwires, so the rank holding the first stage and the one holding the last can each be killed mid-step)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        STEP_CALLS[0] += 1
        if STEP_CALLS[0] == ARMED[0]:
            die()
        return x


ARMED = [0]  # 0: disarmed
STEP_CALLS = [0]


def layers() -> list[sw.Layer]:
    lm = mdl.lm(4)
    return [sw.Layer(Tripwire), lm[0], sw.Layer(nn.Dropout, 0.2), *lm[1:], sw.Layer(Tripwire)]


def kills_for(spec: str, attempt: int, rank: int) -> dict[int, str]:
    """step -> when, for this attempt and rank."""
    found = {}
    for item in filter(None, spec.split(",")):
        a, r, step, when = item.split(":")
        if int(a) == attempt and int(r) == rank:
            found[int(step)] = when
    return found


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--save-every", type=int, default=2)
    p.add_argument("--kills", default="")
    args = p.parse_args()
    sw.init(timeout=60)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank = int(os.environ.get("RANK", "0"))
    torch.manual_seed(1000 + rank)  # dropout's stream: the same in every job; a resume brings the saved one back
    (args.out / "attempts").mkdir(parents=True, exist_ok=True)
    (args.out / "attempts" / f"{attempt}-{rank}").touch()
    kills = kills_for(args.kills, attempt, rank)

    pipe = sw.Pipeline(
        layers(),
        loss_fn=mdl.lm_loss,
        schedule="1f1b",
        microbatches=4,
        seed=7,
        optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
        timeout=60,
    )
    info = sw.checkpoint.resume(args.out / "ckpt", pipe)
    start = 0 if info is None else info.step
    losses: list[float] = [] if info is None else list(info.extra["losses"])
    for step in range(start + 1, args.steps + 1):
        when = kills.get(step)
        if when == "before":
            die()
        ARMED[0], STEP_CALLS[0] = (2 if when == "mid" else 0), 0
        x, y = mdl.lm_data(BATCH, seed=100 + step)
        losses.append(pipe.train_step(*pipe.local_batch(x, y)))
        if step % args.save_every == 0 or step == args.steps:
            save(args.out / "ckpt", pipe, step, losses, when == "save")
    return 0


def save(root: Path, pipe: sw.Pipeline, step: int, losses: list[float], kill: bool) -> None:
    if kill:
        written = api.storage.save_tensors

        def then_die(*a: object, **kw: object) -> None:
            written(*a, **kw)  # type: ignore[arg-type]
            die()

        api.storage.save_tensors = then_die  # type: ignore[assignment]
    sw.checkpoint.save(root, pipe, step=step, extra={"losses": losses}, keep=2)


if __name__ == "__main__":
    sys.exit(main())
