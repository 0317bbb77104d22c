"""Re-layout checks on 2 gloo ranks (in the shared 2-rank job): after ``pipe.relayout(...)`` the pipeline is, bit for
bit, a fresh job of the new layout loaded from a checkpoint saved just before (relayout_checks' ``relaid``: every
parameter, buffer, tied copy, Adam's state and ``step``, ``train_steps``, the dropout seed, the next float64
losses, and no process group of the layout before). The model: a tied embedding, BatchNorm (not under dp, whose
per-replica running statistics a checkpoint refuses), dropout, the pipeline's own Adam.

    STAGEWISE_RELAYOUT_DIR=DIR torchrun --standalone --nproc-per-node 2 tests/distributed/workers/worker.py \
        --checks relayout2_checks --out OUT
"""

from __future__ import annotations

from typing import Any

import stagewise as sw
from relayout_checks import STEPS, build, relaid, stream, train
from worker import Check, Ctx


def check_partition(ctx: Ctx) -> dict[str, Any]:
    """A partition moved at the same pp (2 ranks, 1f1b), micro-batches 4 -> 2; trained on with ``train_stream``
    (the global batches, sliced by ``local_batch``, as after any re-layout)."""
    pipe = build()
    train(pipe, 0)
    return relaid(pipe, ctx, "2-partition", STEPS, None, trainer=stream, partition=[5, 3], microbatches=2)


def check_schedules(ctx: Ctx) -> dict[str, Any]:
    """1f1b -> zb-v -> interleaved-1f1b -> 1f1b on 2 ranks (4 stages under the two with 2 virtual stages)."""
    pipe = build()
    train(pipe, 0)
    out, step = {}, STEPS
    for tag, layout in [
        ("zbv", {"schedule": "zb-v", "virtual_stages": 2}),
        ("interleaved", {"schedule": "interleaved-1f1b", "virtual_stages": 2}),
        ("back-1f1b", {"schedule": "1f1b", "virtual_stages": 1}),
    ]:
        out[tag] = relaid(pipe, ctx, f"2-schedules-{tag}", step, None, **layout)
        step += STEPS
    return out


def check_pp_dp(ctx: Ctx) -> dict[str, Any]:
    """pp 2 -> dp 2 (pp 1: each process the whole model, half the batch) -> pp 2."""
    pipe = build(bn=False)
    train(pipe, 0)
    dp2 = sw.ParallelConfig(pp=1, dp=2)
    out = {"dp2": relaid(pipe, ctx, "2-dp2", STEPS, None, bn=False, parallel=dp2, microbatches=2)}
    out["pp2"] = relaid(pipe, ctx, "2-pp2", 2 * STEPS, None, bn=False, parallel=None, microbatches=4)
    return out


def build_owned(group: Any = None, bn: bool = True, **layout: Any) -> sw.Pipeline:
    """:func:`build` with ``clip=`` and ``offload="optimizer"``."""
    return build(group, bn, clip=0.05, offload="optimizer", **layout)


def check_clip_offload(ctx: Ctx) -> dict[str, Any]:
    """A partition moved with ``clip=`` and ``offload="optimizer"`` (a user pass: every step after a re-layout failed
    with ``clip=``, whose part held the emptied pipeline object; the offloaded optimizer's host copies of the moved
    layers were the build's values, and its first step wrote them back, silently)."""
    pipe = build_owned()
    train(pipe, 0)
    return relaid(pipe, ctx, "2-clip-offload", STEPS, None, make=build_owned, partition=[3, 5])


def checks(world: int) -> dict[str, Check]:
    assert world == 2, "relayout2_checks runs on 2 ranks"
    return {
        "partition": check_partition,
        "schedules": check_schedules,
        "pp2-dp2": check_pp_dp,
        "clip-offload": check_clip_offload,
    }
