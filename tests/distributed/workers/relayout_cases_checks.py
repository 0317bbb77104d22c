"""More re-layout cases on 4 gloo ranks (checks of relayout_checks' job), each exact, bit for bit, against a fresh job
of the new layout loaded from a checkpoint saved just before (relayout_checks' ``relaid``): dp 4 (from pp 2 x dp 2,
to pp 4 and back), a model cut at its ``pipeline_stage`` tags (stages moving to other processes), ``from_hf`` with
a tied embedding (its tensors moving to fewer processes and back), ``relayout(plan=...)``, and the asynchronous
schedules (PipeDream with weight stashing, 2BW, XPipe) between two windows.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

import stagewise as sw
from helpers import hf_families as hf
from helpers import models as mdl
from relayout_checks import STEPS, TiedLM, adam, build, layers, relaid, stream, train
from stagewise.planning import Plan
from worker import Check, Ctx, raises


def check_dp4(ctx: Ctx) -> dict[str, Any]:
    """pp 2 x dp 2 -> dp 4 (pp 1: every process the whole model) -> pp 4 -> dp 4 -> pp 2 x dp 2; 2 micro-batches
    under dp (a replica's share of the global batch is 2 or 4 rows)."""
    pipe = build(bn=False, parallel=sw.ParallelConfig(pp=2, dp=2), microbatches=2)
    train(pipe, 0)
    dp4 = sw.ParallelConfig(pp=1, dp=4)
    out = {"dp4": relaid(pipe, ctx, "dp4", STEPS, None, bn=False, parallel=dp4, microbatches=2)}
    out["pp4"] = relaid(pipe, ctx, "dp4-pp4", 2 * STEPS, None, bn=False, parallel=None, microbatches=4)
    out["dp4-again"] = relaid(pipe, ctx, "pp4-dp4", 3 * STEPS, None, bn=False, parallel=dp4, microbatches=2)
    ppdp = sw.ParallelConfig(pp=2, dp=2)
    out["pp2xdp2"] = relaid(pipe, ctx, "dp4-ppdp", 4 * STEPS, None, bn=False, parallel=ppdp, microbatches=2)
    return out


def tagged_model() -> nn.Module:
    """:class:`TiedLM` with ``pipeline_stage`` tags: 4 stages (embedding, BatchNorm, two blocks, the tied head)."""
    model = TiedLM()
    model.embed.pipeline_stage = 0
    for k, s in enumerate([0, 1, 1, 2, 2, 3]):
        model.blocks[k].pipeline_stage = s
    model.head.pipeline_stage = 3
    return model


def build_tagged(group: Any = None, bn: bool = True, **layout: Any) -> sw.Pipeline:
    options: dict[str, Any] = {"schedule": "1f1b", "microbatches": 4, **layout}
    if group is not None:
        options["group"] = group
    return sw.Pipeline.from_model(
        tagged_model(), loss_fn=mdl.lm_loss, optimizer=adam, batchnorm="micro", timeout=60, **options
    )


def check_tagged(ctx: Ctx) -> dict[str, Any]:
    """A model cut at its tags (4 stages): onto processes 0 and 1 (interleaved-1f1b, 2 stages each: stages 2
    and 3 move), then back onto 4 under 1f1b."""
    pipe = build_tagged()
    train(pipe, 0)
    onto_two = {"schedule": "interleaved-1f1b", "virtual_stages": 2}
    out = {"shrink": relaid(pipe, ctx, "tagged-2", STEPS, [0, 1], make=build_tagged, **onto_two)}
    back = {"schedule": "1f1b", "virtual_stages": 1}
    out["grow"] = relaid(pipe, ctx, "tagged-4", 2 * STEPS, None, make=build_tagged, **back)
    return out


def build_hf(group: Any = None, bn: bool = True, **layout: Any) -> sw.Pipeline:
    """``from_hf`` of a tiny float64 Llama whose head is tied to its embedding (4 decoder layers), with Adam."""
    model = hf.build("llama", 4, tied=True)
    assert hf.is_tied(model)
    options: dict[str, Any] = {"schedule": "1f1b", "microbatches": 2, **layout}
    if group is not None:
        options["group"] = group
    return sw.Pipeline.from_hf(model, optimizer=adam, timeout=60, **options)


def train_hf(pipe: Any, start: int, steps: int = STEPS) -> list[float]:
    out = []
    for step in range(start, start + steps):
        inputs, labels = hf.padded_batch(4, seed=step)
        out.append(pipe.train_step(*pipe.local_batch(inputs, labels)))
    return out


def check_from_hf(ctx: Ctx) -> dict[str, Any]:
    """``from_hf`` (tied embedding): pp 4 -> pp 2 on processes 0 and 1 (the last stages' layers and the tied copy
    move) -> pp 4 again."""
    pipe = build_hf()
    train_hf(pipe, 0)
    make = build_hf
    out = {"shrink": relaid(pipe, ctx, "hf-2", STEPS, [0, 1], bn=False, make=make, trainer=train_hf)}
    out["grow"] = relaid(pipe, ctx, "hf-4", 2 * STEPS, None, bn=False, make=make, trainer=train_hf)
    return out


def a_plan(**fields: Any) -> Plan:
    """A plan for the 8 layers at pp 4 (what ``sw.plan`` returns; its predictions play no part in running it)."""
    base: dict[str, Any] = {
        "layout": sw.ParallelConfig(pp=4),
        "schedule": "gpipe",
        "virtual_stages": 1,
        "microbatches": 2,
        "microbatch_size": 4,
        "partition": (2, 3, 2, 1),
        "recompute": None,
        "step_time": 1.0,
        "bubble": 0.0,
        "memory": (),
    }
    return Plan(**{**base, **fields})


def build_planned(group: Any = None, bn: bool = True, plan: Any = None, **layout: Any) -> sw.Pipeline:
    """The reference of ``relayout(plan=plan)``: ``from_plan(plan, layers)`` with the pipeline's other options."""
    options: dict[str, Any] = dict(layout)
    if group is not None:
        options["group"] = group
    return sw.Pipeline.from_plan(
        plan, layers(bn), loss_fn=mdl.lm_loss, seed=3, optimizer=adam, batchnorm="micro", timeout=60, **options
    )


def check_plan(ctx: Ctx) -> dict[str, Any]:
    """``pipe.relayout(plan=...)`` on a layer list: the plan's partition, schedule and micro-batches, then a
    second plan (interleaved-1f1b, 2 virtual stages) on the pipeline the first made. A plan's mesh spans the
    world: a plan on fewer members is refused alike on every rank (before, the plan's layout and the members'
    group clashed in every member's build: "pass either group= or parallel=")."""
    pipe = build()
    train(pipe, 0)
    first = a_plan()
    raises(ValueError, "keep all 4 as members", lambda: pipe.relayout([0, 1], plan=first))
    out = {"gpipe": relaid(pipe, ctx, "plan", STEPS, None, make=build_planned, plan=first)}
    second = a_plan(schedule="interleaved-1f1b", virtual_stages=2, partition=(1, 1, 1, 1, 1, 1, 1, 1))
    out["interleaved"] = relaid(pipe, ctx, "plan-2", 2 * STEPS, None, make=build_planned, plan=second)
    return out


def sgd_momentum(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1e-2, momentum=0.9)


def untied_layers() -> list[sw.Layer]:
    """The 8 layers with a head of its own (an asynchronous schedule refuses a tie: its uses would step at
    different times) and no BatchNorm."""
    return [
        sw.Layer(nn.Embedding, mdl.VOCAB, mdl.D, dtype=torch.float64),
        *[sw.Layer(mdl.Block) for _ in range(5)],
        sw.Layer(nn.LayerNorm, mdl.D, dtype=torch.float64),
        sw.Layer(nn.Linear, mdl.D, mdl.VOCAB, dtype=torch.float64),
    ]


def build_async(name: str, group: Any = None, bn: bool = True, **layout: Any) -> sw.Pipeline:
    """An asynchronous schedule (windows of 2 mini-batches of 2 micro-batches, 4 for 2BW) on :func:`untied_layers`."""
    options: dict[str, Any] = dict(layout)
    if group is not None:
        options["group"] = group
    micro = 4 if name == "pipedream-2bw" else 2  # 2BW: at least p - 1 micro-batches per mini-batch
    options.setdefault("schedule", sw.schedules.async_schedule(name, 4, 2, micro))
    opt = sgd_momentum if name == "xpipe" else adam
    return sw.Pipeline(untied_layers(), loss_fn=mdl.lm_loss, seed=3, optimizer=opt, timeout=60, **options)


def check_asynchronous(ctx: Ctx) -> dict[str, Any]:
    """PipeDream (weight stashing), 2BW and XPipe: trained a window through ``train_stream``, then a partition
    moved between two windows (nothing is in flight there: the next window counts versions afresh from the
    weights and optimizer state the last one left)."""
    out = {}
    for name in ("pipedream", "pipedream-2bw", "xpipe"):
        make = functools.partial(build_async, name)
        pipe = make()
        stream(pipe, 0)
        out[name] = relaid(pipe, ctx, f"async-{name}", STEPS, None, bn=False, make=make, trainer=stream,
                           partition=[3, 1, 2, 2])  # fmt: skip
    return out


CHECKS: dict[str, Check] = {
    "dp4": check_dp4,
    "tagged": check_tagged,
    "from-hf": check_from_hf,
    "plan": check_plan,
    "asynchronous": check_asynchronous,
}
