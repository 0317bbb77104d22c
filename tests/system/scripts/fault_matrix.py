"""One rank of a 4-rank job in which one rank gets into trouble, with torchrun's store placement: rank 0 hosts it.

    RANK=r WORLD_SIZE=4 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python fault_matrix.py --fault KIND --victim V
        --where WHERE --out DIR

The ranks join with :func:`stagewise.init` (``env://``: rank 0's process hosts the TCPStore, as under torchrun
without an agent store), so a stopped or killed rank 0 takes the coordinator with it. ``KIND``: ``sigkill``,
``sigstop`` or ``exception`` (a ValueError left uncaught: the exit hook posts it and exits 1). ``WHERE``:
``constructor`` (while the victim builds its layers; the model has a tied embedding / head, so ranks 0 and 3
create a process group there), ``step`` (the victim's third forward of step 1) or ``clip`` (just before
``clip_grad_norm_``, which the others enter). ``--fault none`` trains and clips two steps and exits 0.

Every rank writes ``DIR/rankR.txt``: ``ok <loss>``, or the exception that ended it (then re-raised, uncaught).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import stagewise as sw

D, V, M = 8, 11, 4
TIMEOUT = 15.0


class Trap:
    """What this rank does wrong, and where (shared with fault_axes.py)."""

    fault = "none"
    where = ""
    armed = False
    profiling = False  # fault_axes.py: this rank is profiling its layers


def fire(where: str) -> None:
    """Get into trouble here, if this rank is the victim and this is the place."""
    if not Trap.armed or Trap.where != where:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    if Trap.fault == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if Trap.fault == "sigstop":
        os.kill(os.getpid(), signal.SIGSTOP)  # the test kills it once the others are done
    if Trap.fault == "exception":
        raise ValueError(f"the tripwire fired ({where})")


class Tripwire(nn.Module):
    """Identity; fires at construction (``constructor``) or at its third training forward of step 1 (``step``)."""

    calls = 0

    def __init__(self) -> None:
        super().__init__()
        fire("constructor")

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and Trap.where == "step" and Trap.armed:
            if Tripwire.calls == M + 2:  # step 1 (step 0 ran M forwards), micro-batch 2
                fire("step")
            Tripwire.calls += 1
        return h


def layers() -> list[sw.Layer]:
    """4 stages under 1f1b: a tied embedding (stage 0) and head (stage 3), a tripwire on every stage."""
    body = [[sw.Layer(nn.Linear, D, D, dtype=torch.float64), sw.Layer(nn.Tanh), sw.Layer(Tripwire)] for _ in range(4)]
    return [
        sw.Tied("embed", sw.Layer(nn.Embedding, V, D, dtype=torch.float64)),
        *body[0],
        *body[1],
        *body[2],
        *body[3],
        sw.Tied("embed", forward_fn=lambda emb, h: h @ emb.weight.T),
    ]


PARTITION = [4, 3, 3, 4]


def record(report: Path, err: BaseException) -> None:
    """The exception that ends this rank: a PipelineError's message, anything else's traceback."""
    report.write_text(f"{type(err).__name__}: {err}" if isinstance(err, sw.PipelineError) else traceback.format_exc())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fault", choices=["none", "sigkill", "sigstop", "exception"], required=True)
    parser.add_argument("--victim", type=int, default=-1)
    parser.add_argument("--where", choices=["constructor", "step", "clip"], default="step")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    env = sw.init("gloo", timeout=60.0)
    Trap.fault, Trap.where = args.fault, args.where
    Trap.armed = args.fault != "none" and env.rank == args.victim
    report = args.out / f"rank{env.rank}.txt"
    try:
        pipe = sw.Pipeline(
            layers(), loss_fn=F.cross_entropy, schedule="1f1b", microbatches=M, partition=PARTITION, timeout=TIMEOUT
        )
        g = torch.Generator().manual_seed(0)
        x, y = torch.randint(0, V, (2 * M,), generator=g), torch.randint(0, V, (2 * M,), generator=g)
        loss = 0.0
        for _ in range(2):
            loss = pipe.train_step(x, y)
            fire("clip")
            pipe.clip_grad_norm_(1.0)
            pipe.zero_grad()
        report.write_text(f"ok {loss!r}")
    except BaseException as err:
        record(report, err)
        raise  # uncaught: stagewise's exit hook posts it and exits 1


if __name__ == "__main__":
    main()
