"""One rank of a 4-rank job in which one rank gets into trouble where torch, not stagewise, waits (issue 17).

    RANK=r WORLD_SIZE=4 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python fault_axes.py --fault KIND --victim V
        --where WHERE --out DIR

Rank 0 hosts the store (``env://``), as in fault_matrix.py; ``KIND`` as there. ``WHERE``:

* ``shard``: pp=2 x sharding=2 (FSDP2); the victim's second forward of step 1. Its sharding peer is then in
  FSDP2's reduce-scatter at SYNC, a gloo wait inside torch that only the group's timeout (the pipeline's)
  or a closed connection ends;
* ``profile``: partition="time" on 4 ranks: rank 0 profiles the layers while the others wait for its profile;
  victim 0 fires inside its profiling, another victim right before building the pipeline;
* ``plain``: the job joins with ``torch.distributed.init_process_group`` (no ``stagewise.init``): the victim
  raises after building its Pipeline, outside any step; the exit hook, installed by the Pipeline, posts it.

The default group keeps init's 10-minute timeout: a wait bounded by nothing but that would outlive the
test's guard. ``--timeout``: the pipelines' (20 s). Every rank writes ``DIR/rankR.txt`` as fault_matrix.py does.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import stagewise as sw
from fault_matrix import Trap, fire, record

D, V, M = 8, 5, 4
TIMEOUT = 20.0


class Tripwire(nn.Module):
    """Identity; fires in profiling (``profile``) or at its second training forward of step 1 (``shard``)."""

    calls = 0

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if Trap.profiling:
            fire("profile")
        elif torch.is_grad_enabled() and Trap.where == "shard" and Trap.armed:
            if Tripwire.calls == M // 2 + 1:  # step 1 (step 0 ran M / 2 forwards on this replica), micro-batch 1
                fire("shard")
            Tripwire.calls += 1
        return h


def layers() -> list[sw.Layer]:
    """Two or four stages, one tripwire on each."""
    return [
        sw.Layer(nn.Linear, D, D, dtype=torch.float64),
        sw.Layer(Tripwire),
        sw.Layer(nn.Linear, D, D, dtype=torch.float64),
        sw.Layer(Tripwire),
        sw.Layer(nn.Linear, D, D, dtype=torch.float64),
        sw.Layer(Tripwire),
        sw.Layer(nn.Linear, D, V, dtype=torch.float64),
        sw.Layer(Tripwire),
    ]


def pipeline(where: str, x: torch.Tensor, timeout: float) -> sw.Pipeline:
    common = dict(loss_fn=F.cross_entropy, schedule="1f1b", timeout=timeout)
    if where == "shard":
        return sw.Pipeline(layers(), microbatches=M // 2, parallel=sw.ParallelConfig(pp=2, sharding=2), **common)
    if where == "profile":
        Trap.profiling = True
        try:
            return sw.Pipeline(layers(), microbatches=M, partition="time", sample_inputs=x[:2], **common)
        finally:
            Trap.profiling = False
    return sw.Pipeline(layers(), microbatches=M, **common)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fault", choices=["none", "sigkill", "sigstop", "exception"], required=True)
    parser.add_argument("--victim", type=int, default=-1)
    parser.add_argument("--where", choices=["shard", "profile", "plain"], required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--timeout", type=float, default=TIMEOUT)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.where == "plain":
        dist.init_process_group("gloo")
        rank = dist.get_rank()
    else:
        rank = sw.init("gloo").rank
    Trap.fault, Trap.where, Trap.out = args.fault, args.where, args.out
    Trap.armed = args.fault != "none" and rank == args.victim
    report = args.out / f"rank{rank}.txt"
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(2 * M, D, generator=g, dtype=torch.float64), torch.randint(0, V, (2 * M,), generator=g)
    try:
        if args.where == "profile" and rank != 0:
            fire("profile")  # while rank 0 profiles and the others wait for its profile
        pipe = pipeline(args.where, x, args.timeout)
        if args.where == "plain":
            fire("plain")
        loss = 0.0
        for _ in range(2):
            loss = pipe.train_step(*pipe.local_batch(x, y))
            pipe.zero_grad()
        report.write_text(f"ok {loss!r}")
    except BaseException as err:
        record(report, err)
        raise  # uncaught: stagewise's exit hook posts it and exits 1


if __name__ == "__main__":
    main()
