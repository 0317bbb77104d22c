"""One rank of a 4-rank job in which one rank gets into trouble, with torchrun's store placement: rank 0 hosts it.

    RANK=r WORLD_SIZE=4 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python fault_matrix.py --fault KIND --victim V
        --where WHERE --out DIR [--timeout S]

The ranks join with :func:`stagewise.init` (``env://``: rank 0's process hosts the TCPStore, as under torchrun
without an agent store), so a stopped or killed rank 0 takes the coordinator with it. ``KIND``: ``sigkill``,
``sigstop`` or ``exception`` (a ValueError left uncaught: the exit hook posts it and exits 1). ``WHERE``, with
what the others are doing when the victim fires:

* ``constructor``: the victim builds its layers (the model has a tied embedding / head, so ranks 0 and 3 create
  a process group there); the others build their pipelines;
* ``step``: the victim's third forward of train step 1; the others wait for activations or gradients;
* ``clip``: just before ``clip_grad_norm_``; the others are in its all-reduce;
* ``eval``: the victim's third forward of an ``eval_step``;
* ``save``: ``sw.checkpoint.save`` after the victim wrote its share; the others wait for it to finish writing;
* ``load``: ``sw.checkpoint.load`` as the victim starts hashing its share of the files; the others wait for
  the verdicts;
* ``stream``: an asynchronous schedule (PipeDream) trained with ``train_stream``: the third forward of the
  second window;
* ``wave``: :class:`~stagewise.HetPipe`, two virtual workers of two stages: the third forward of wave 1; the
  other worker waits in the wave's reduction.

``--fault none`` runs the same program without a fault and exits 0. ``--timeout``: the pipelines' (10 s).

Every rank writes ``DIR/rankR.txt``: ``ok <loss>``, or the exception that ended it (then re-raised, uncaught),
and ``DIR/rankR.time``: when it caught it (``time.time()``); the victim writes ``DIR/fault.time`` as it fires.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import stagewise as sw
from stagewise.runtime.checkpoint import manifest, storage

D, V, M = 8, 11, 4
WHERES = ("step", "constructor", "clip", "eval", "save", "load", "stream", "wave")
FORWARDS = ("step", "eval", "stream", "wave")  # fired from a layer's forward, once the program says so


class Trap:
    """What this rank does wrong, and where (shared with fault_axes.py)."""

    fault = "none"
    where = ""
    armed = False
    live = False  # the phase in which a forward fires has begun
    profiling = False  # fault_axes.py: this rank is profiling its layers
    out: Path | None = None


def fire(where: str) -> None:
    """Get into trouble here, if this rank is the victim and this is the place."""
    if not Trap.armed or Trap.where != where:
        return
    if Trap.out is not None:
        (Trap.out / "fault.time").write_text(repr(time.time()))
    sys.stdout.flush()
    sys.stderr.flush()
    if Trap.fault == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if Trap.fault == "sigstop":
        os.kill(os.getpid(), signal.SIGSTOP)  # the harness kills it once the others are done
    if Trap.fault == "exception":
        raise ValueError(f"the tripwire fired ({where})")


class Tripwire(nn.Module):
    """Identity; fires at construction (``constructor``), or at its third forward once the phase is live."""

    calls = 0

    def __init__(self) -> None:
        super().__init__()
        fire("constructor")

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if Trap.armed and Trap.live and Trap.where in FORWARDS:
            if Tripwire.calls == 2:
                fire(Trap.where)
            Tripwire.calls += 1
        return h


def tied_layers() -> list[sw.Layer]:
    """4 stages under 1f1b: a tied embedding (stage 0) and head (stage 3), a tripwire on every stage."""
    body = [[sw.Layer(nn.Linear, D, D, dtype=torch.float64), sw.Layer(nn.Tanh), sw.Layer(Tripwire)] for _ in range(4)]
    return [
        sw.Tied("embed", sw.Layer(nn.Embedding, V, D, dtype=torch.float64)),
        *[layer for stage in body for layer in stage],
        sw.Tied("embed", forward_fn=lambda emb, h: h @ emb.weight.T),
    ]


def plain_layers() -> list[sw.Layer]:
    """Four blocks (one per stage of 4, two per stage of 2) with a tripwire each, and a head."""
    body = [[sw.Layer(nn.Linear, D, D, dtype=torch.float64), sw.Layer(nn.Tanh), sw.Layer(Tripwire)] for _ in range(4)]
    return [
        sw.Layer(nn.Embedding, V, D, dtype=torch.float64),
        *[x for b in body for x in b],
        sw.Layer(nn.Linear, D, V, dtype=torch.float64),
    ]


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01)


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, V, (2 * M,), generator=g), torch.randint(0, V, (2 * M,), generator=g)) for _ in range(n)]


def after(fn: Callable[..., Any], where: str, first: bool = False) -> Callable[..., Any]:
    """``fn`` that fires ``where`` after it ran (``first``: before)."""

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if first:
            fire(where)
        out = fn(*args, **kwargs)
        if not first:
            fire(where)
        return out

    return wrapped


def synchronous(where: str, timeout: float, out: Path) -> float:
    """constructor, step, clip, eval, save, load: the tied 4-stage pipeline."""
    # clip: the user's clip_grad_norm_ between steps, which optimizer= refuses by name
    pipe = sw.Pipeline(
        tied_layers(), loss_fn=F.cross_entropy, schedule="1f1b", microbatches=M, partition=[4, 3, 3, 4],
        optimizer=None if where == "clip" else sgd, timeout=timeout,
    )  # fmt: skip
    data = batches(2)
    loss = pipe.train_step(*data[0])
    if where == "eval":
        Trap.live = True
        pipe.eval_step(data[1][0])
    elif where == "save":
        storage.save_tensors = after(storage.save_tensors, "save")
        sw.checkpoint.save(out / "ckpt", pipe, step=1)
    elif where == "load":
        sw.checkpoint.save(out / "ckpt", pipe, step=1)
        manifest.check_files = after(manifest.check_files, "load", first=True)
        sw.checkpoint.load(out / "ckpt", pipe)
    Trap.live = where == "step"
    loss = pipe.train_step(*data[1])
    fire("clip")
    pipe.clip_grad_norm_(1.0)
    return loss


def stream(timeout: float) -> float:
    """PipeDream's asynchronous windows through ``train_stream``; fires in the second window (a window's losses
    are yielded once it has trained, so the forwards after the first loss are the next window's)."""
    pipe = sw.Pipeline(  # cut by hand: a tripwire on every stage (a default cut may leave stage 0 the embedding)
        plain_layers(), loss_fn=F.cross_entropy, schedule="pipedream", microbatches=M, partition=[4, 3, 3, 4],
        optimizer=sgd, timeout=timeout,
    )  # fmt: skip
    losses = []
    for loss in pipe.train_stream(batches(12)):
        losses.append(loss)
        Trap.live = True
    return losses[-1]


def wave(timeout: float) -> float:
    """HetPipe: virtual workers [0, 1] and [2, 3]; fires in wave 1 (the forwards after wave 0's first loss)."""
    het = sw.HetPipe(
        plain_layers(), loss_fn=F.cross_entropy, virtual_workers=[[0, 1], [2, 3]], optimizer=sgd, timeout=timeout
    )
    losses = []
    for loss in het.train_stream(het.local_batch(x, y) for x, y in batches(12)):
        losses.append(loss)
        Trap.live = True
    return losses[-1]


def record(report: Path, err: BaseException) -> None:
    """The exception that ends this rank: a PipelineError's message, anything else's traceback; and when."""
    report.with_suffix(".time").write_text(repr(time.time()))
    report.write_text(f"{type(err).__name__}: {err}" if isinstance(err, sw.PipelineError) else traceback.format_exc())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fault", choices=["none", "sigkill", "sigstop", "exception"], required=True)
    parser.add_argument("--victim", type=int, default=-1)
    parser.add_argument("--where", choices=WHERES, default="step")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--timeout", type=float, default=10.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    env = sw.init("gloo", timeout=60.0)
    Trap.fault, Trap.where, Trap.out = args.fault, args.where, args.out
    Trap.armed = args.fault != "none" and env.rank == args.victim
    report = args.out / f"rank{env.rank}.txt"
    try:
        if args.where == "stream":
            loss = stream(args.timeout)
        elif args.where == "wave":
            loss = wave(args.timeout)
        else:
            loss = synchronous(args.where, args.timeout, args.out)
        report.write_text(f"ok {loss!r}")
    except BaseException as err:
        record(report, err)
        raise  # uncaught: stagewise's exit hook posts it and exits 1


if __name__ == "__main__":
    main()
