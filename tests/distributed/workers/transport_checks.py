"""The transport's own checks, run under each STAGEWISE_TRANSPORT by tests/distributed/test_runtime_*ranks.py
(the suite ``transport`` of runtime_checks.py): which transport a pipeline gets, and its step exchanges."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import stagewise as sw
from helpers import models as mdl
from worker import Check, Ctx, raises

TIMEOUT = 30.0


def transport_in_use(ctx: Ctx) -> dict[str, str]:
    """Which transport this job's pipelines get (STAGEWISE_TRANSPORT, else auto): the tests compare it."""
    pipe = sw.Pipeline(mdl.mlp(), loss_fn=F.cross_entropy, microbatches=2, group=ctx.group, timeout=TIMEOUT)
    return {"transport": type(pipe.transport).__name__}


def step_exchanges(ctx: Ctx) -> None:
    """The transport's own broadcast and all-reduce (the step's loss, the check for non-finite values): from
    every source and over three rounds (a slot reused), against the values every rank computes alone; values
    are multiples of 1/4, so any summation order gives the same bits. Bad input is named."""
    pipe = sw.Pipeline(mdl.mlp(), loss_fn=F.cross_entropy, microbatches=2, group=ctx.group, timeout=TIMEOUT)
    t, n = pipe.transport, ctx.world

    def value(rank: int, round_: int) -> torch.Tensor:
        return torch.tensor([[rank + 0.25, -rank * round_], [round_ / 4, 7.0 - rank]], dtype=torch.float64)

    for round_ in range(3):
        for src in range(n):
            buf = value(ctx.rank, round_) if ctx.rank == src else torch.full((2, 2), float("nan"), dtype=torch.float64)
            t.broadcast(buf, src, f"round {round_} from {src}")
            assert torch.equal(buf, value(src, round_)), (round_, src, buf)
        total = value(ctx.rank, round_)
        t.all_reduce(total, "sum", f"round {round_}'s sum")
        assert torch.equal(total, sum(value(r, round_) for r in range(n))), (round_, total)
        top = value(ctx.rank, round_).reshape(-1)[:3]
        t.all_reduce(top, "max", f"round {round_}'s max")
        want = torch.stack([value(r, round_).reshape(-1)[:3] for r in range(n)]).amax(0)
        assert torch.equal(top, want), (round_, top, want)
    raises(ValueError, ["'mean'", "sum"], lambda: t.all_reduce(torch.zeros(1), "mean", "a bad op"))
    if type(t).__name__ == "ShmTransport":  # every rank refuses before sending anything
        flag = torch.zeros(4, 2).t()
        raises(ValueError, ["a transposed flag", "contiguous"], lambda: t.all_reduce(flag, "sum", "a transposed flag"))


def transport_checks(world: int) -> dict[str, Check]:
    return {"transport-in-use": transport_in_use, "step-exchanges": step_exchanges}
