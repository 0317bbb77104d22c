"""One rank of a 2-rank job in which rank 1 raises inside ``train_step``, and the script decides how to leave.

    stagewise run -n 2 exit_paths.py --exit sys-exit --out DIR
    RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python exit_paths.py --exit sys-exit --out DIR

``--exit``: ``sys-exit`` catches the error (rank 1's own, rank 0's PipelineError) and calls ``sys.exit(1)`` - the
way out that used to abort rank 0 at exit ("terminate called without an active exception": a helper thread
returned from a gloo wait while the interpreter finalized); ``uncaught`` lets it end the process (the exit hook);
``outside``: rank 1 raises between two steps, in the script's own code, uncaught (it used to die still holding the
shared-memory names its peer had removed, and Python's resource tracker warned of "leaked" objects);
``none`` trains without a fault (exit 0). Four ways of calling a collective on some ranks only, each after two
steps: ``save-on-0`` (rank 0 saves a checkpoint, rank 1 trains on), ``eval-on-1`` (rank 1 evaluates, rank 0 trains
on), ``one-more-on-0`` (rank 0 trains once more; rank 1's script ends), ``relayout-on-0`` (rank 0 re-lays the
pipeline out, rank 1 trains on). Every rank writes ``DIR/rankR.txt``:
``ok``, or the error it caught. ``--transport``: the pipeline's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import stagewise as sw


class Boom(nn.Module):
    """Identity, until armed: then it raises (rank 1 holds it)."""

    armed = False

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if Boom.armed:
            raise ValueError("the layer on rank 1 raised")
        return h


#: way -> (the rank that makes one call more, that call), after two steps on both ranks; then both train once more
#: (the third step of the one-more way is the rank's extra call: the other's script ends)
MISMATCHES = {
    "save-on-0": (0, "save"),
    "eval-on-1": (1, "eval"),
    "one-more-on-0": (0, "step"),
    "relayout-on-0": (0, "relayout"),
}


def _mismatch(way: str, pipe: sw.Pipeline, rank: int, x: torch.Tensor, y: torch.Tensor, out: Path) -> None:
    who, extra = MISMATCHES[way]
    pipe.train_step(x, y)
    pipe.train_step(x, y)
    if rank == who:
        if extra == "save":
            sw.checkpoint.save(out / "checkpoints", pipe, step=2)
        elif extra == "eval":
            pipe.eval_loss(x, y)
        elif extra == "relayout":
            pipe.relayout(schedule="gpipe")
        else:
            pipe.train_step(x, y)
    if extra != "step":
        pipe.train_step(x, y)


def main() -> None:
    parser = argparse.ArgumentParser()
    ways = ["sys-exit", "uncaught", "outside", "none", *MISMATCHES]
    parser.add_argument("--exit", choices=ways, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--transport", default="auto")
    args = parser.parse_args()
    torch.set_num_threads(1)
    env = sw.init("gloo", timeout=60.0)
    layers = [sw.Layer(nn.Linear, 8, 8), sw.Layer(nn.Tanh), sw.Layer(Boom), sw.Layer(nn.Linear, 8, 3)]
    pipe = sw.Pipeline(
        layers, loss_fn=F.cross_entropy, schedule="1f1b", microbatches=4, timeout=20.0, transport=args.transport
    )
    x, y = torch.randn(8, 8, generator=torch.Generator().manual_seed(0)), torch.arange(8) % 3
    report = args.out / f"rank{env.rank}.txt"
    if args.exit in MISMATCHES:
        try:
            _mismatch(args.exit, pipe, env.rank, x, y, args.out)
        except Exception as err:
            report.write_text(f"{type(err).__name__}: {err}")
            sys.exit(1)
        report.write_text("ok")
        return
    if args.exit == "outside" and env.rank == 1:
        pipe.train_step(x, y)
        report.write_text("outside")
        raise ValueError("the script on rank 1 raised between two steps")
    Boom.armed = args.exit not in ("none", "outside") and env.rank == 1
    if args.exit == "uncaught":
        report.write_text("uncaught")
        pipe.train_step(x, y)
    try:
        pipe.train_step(x, y)
        if args.exit == "outside":  # (rank 0: the first step may stop already, at rank 1's posted failure)
            pipe.train_step(x, y)
    except Exception as err:
        report.write_text(f"{type(err).__name__}: {err}")
        sys.exit(1)
    report.write_text("ok")


if __name__ == "__main__":
    main()
