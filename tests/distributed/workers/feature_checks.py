"""Checks for the training features of issue 5 (part A), run on every rank of one torchrun job.

    torchrun --standalone --nproc-per-node 2 tests/distributed/workers/worker.py --checks feature_checks \
        --out DIR [--only a,b]

Tied parameters, recompute, global gradient clipping, auxiliary losses, frozen
parameters and no-grad values crossing stages, BatchNorm, and the measured
activation memory against the simulator; at 4 ranks also gradient merge (merge_checks.py) and
reproducible dropout (dropout_checks.py). Each check compares with the
one-process model (``sw.build_model``) in float64, raises to fail and may return
a dict of figures (written with its result, one JSON line per check and rank).
``checks(world)`` is a pure function of the world size. The models are in feature_models.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import dropout_checks
import merge_checks
import metrics_checks
import owned_checks
import stagewise as sw
from feature_models import (
    CLASSES,
    D,
    aux_mlp,
    bn_model,
    frozen_model,
    gelu_mlp,
    lm_data,
    lm_loss,
    mlp_data,
    tied_lm,
)
from helpers.compare import ATOL, RTOL, assert_grads_close, assert_params_close
from worker import Check, Ctx, gather_objects

TIMEOUT = 60.0
SCHEDULES = ("1f1b", "zb-v", "zb-h1", "interleaved-1f1b")


# ---- helpers ------------------------------------------------------------------------
def pipeline(ctx: Ctx, layers: list, loss_fn: Any, schedule: str, m: int, **kw: Any) -> sw.Pipeline:
    return sw.Pipeline(
        layers, loss_fn=loss_fn, schedule=schedule, microbatches=m, group=ctx.group, timeout=TIMEOUT, **kw
    )


def close(a: float, b: float, what: str) -> None:
    assert abs(a - b) <= 1e-10 * max(1.0, abs(b)), f"{what}: {a} vs {b}"


def _saved_bytes(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
    """The bytes one process's forward and loss save for the backward (each storage once, parameters not counted):
    the reference."""
    seen: dict[int, int] = {}
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:  # (a weight's transpose, saved by the Linear: a parameter)
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        F.cross_entropy(model(x), y)
    return sum(seen.values())


# ---- checks -------------------------------------------------------------------------
def memory_tp(ctx: Ctx) -> dict[str, Any]:
    """``measure_memory=`` under ``tp_plan=`` (it failed the first forward: a column-parallel Linear saves a DTensor,
    which has no storage of its own). Column then row parallel over every rank: each rank keeps its shards of the
    two wide activations (the GELU's input and the row Linear's) and the whole of the rest, what one process saves
    less (1 - 1/tp) of those two."""
    wide = 4 * D
    layers = [sw.Layer(nn.Linear, D, wide, dtype=torch.float64), sw.Layer(nn.GELU),
              sw.Layer(nn.Linear, wide, CLASSES, dtype=torch.float64)]  # fmt: skip
    plan = {"0": sw.runtime.column_parallel(), "2": sw.runtime.row_parallel()}
    pipe = sw.Pipeline(
        layers, loss_fn=F.cross_entropy, microbatches=1, group=ctx.group, timeout=TIMEOUT, measure_memory=True,
        parallel=sw.ParallelConfig(pp=1, tp=ctx.world), tp_plan=plan,
    )  # fmt: skip
    x, y = mlp_data(6, seed=0)
    ref = sw.build_model(layers)
    close(pipe.train_step(x, y), F.cross_entropy(ref(x), y).item(), "tp loss")
    got = pipe.memory_report()["forward_bytes"][(0, 0)]
    whole = _saved_bytes(ref, x, y)
    expect = whole - 2 * 6 * wide * 8 * (ctx.world - 1) // ctx.world
    assert got == expect, f"rank {ctx.rank}: {got} bytes saved, expected {expect} (one process: {whole})"
    return {"bytes": got, "one_process": whole}


def tied(schedule: str) -> Check:
    """Tied embedding / head: loss and gradients, the state dict saved once, clipping counting the weight once,
    and two SGD steps keeping the copies equal."""

    def check(ctx: Ctx) -> dict[str, Any]:
        layers, m = tied_lm(), 3
        pipe = pipeline(ctx, layers, lm_loss, schedule, m, seed=3)
        ref = sw.build_model(layers, seed=3)
        opt = torch.optim.SGD(pipe.parameters(), lr=0.5)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
        for step in range(2):
            x, y = lm_data(7, seed=step)
            loss = pipe.train_step(x, y)
            ref_loss = lm_loss(ref(x), y)
            ref_loss.backward()
            close(loss, ref_loss.item(), f"step {step} loss")
            assert_grads_close(pipe, ref, f"step {step}")
            norm = pipe.clip_grad_norm_(0.05)
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05).item()
            close(norm, ref_norm, f"step {step} grad norm")
            assert_grads_close(pipe, ref, f"step {step} clipped")
            opt.step(), ref_opt.step()
            opt.zero_grad(), ref_opt.zero_grad()
        assert_params_close(pipe, ref, "after two steps")
        keys = gather_objects(list(pipe.state_dict()), ctx.group)
        flat = [k for ks in keys for k in ks]
        assert sorted(flat) == sorted(ref.state_dict()), flat
        owners = sorted({pipe.schedule.placement[0], pipe.schedule.placement[-1]})
        return {"owners": owners, "synced": len(pipe.tied.groups)}

    return check


def two_mlp_steps(pipe: sw.Pipeline, ref: nn.Module, m: int) -> torch.Tensor:
    """Two steps on uneven micro-batches (2m + 1 samples): loss and every gradient against ``ref``; the last inputs."""
    for step in range(2):
        x, y = mlp_data(2 * m + 1, seed=step)
        loss = pipe.train_step(x, y)
        ref.zero_grad()
        ref_loss = F.cross_entropy(ref(x), y)
        ref_loss.backward()
        close(loss, ref_loss.item(), f"step {step} loss")
        assert_grads_close(pipe, ref, f"step {step}")
        pipe.zero_grad()
    return x


def recompute(schedule: str, how: Any) -> Check:
    def check(ctx: Ctx) -> None:
        layers, m = gelu_mlp(), 4
        pipe = pipeline(ctx, layers, F.cross_entropy, schedule, m, recompute=how)
        ref = sw.build_model(layers)
        x = two_mlp_steps(pipe, ref, m)
        out = pipe.eval_step(x)
        if out is not None:
            torch.testing.assert_close(out, ref(x), rtol=RTOL, atol=ATOL)

    return check


def clip(schedule: str) -> Check:
    """clip_grad_norm_ over the whole pipeline equals torch's on the one-process model (2-norm and inf-norm)."""

    def check(ctx: Ctx) -> None:
        layers, m = gelu_mlp(), 4
        pipe = pipeline(ctx, layers, F.cross_entropy, schedule, m)
        ref = sw.build_model(layers)
        for norm_type in (2.0, float("inf")):
            x, y = mlp_data(9, seed=5)
            pipe.zero_grad()
            ref.zero_grad()
            pipe.train_step(x, y)
            F.cross_entropy(ref(x), y).backward()
            norm = pipe.clip_grad_norm_(0.1, norm_type)
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1, norm_type).item()
            close(norm, ref_norm, f"{norm_type}-norm")
            assert_grads_close(pipe, ref, f"clipped {norm_type}-norm")

    return check


def aux(schedule: str, how: Any = None) -> Check:
    """Aux losses on intermediate stages: gradients as loss + aux on the whole batch; the loss breakdown."""

    def check(ctx: Ctx) -> None:
        layers, m = aux_mlp(), 4
        pipe = pipeline(ctx, layers, F.cross_entropy, schedule, m, recompute=how)
        ref = sw.build_model(layers)
        for step in range(2):
            x, y = mlp_data(4 * m, seed=step)  # equal micro-batches: each weighs 1/m
            loss = pipe.train_step(x, y)
            ref.zero_grad()
            with sw.runtime.collect_aux_losses() as terms:
                out = ref(x)
            ref_main = F.cross_entropy(out, y)
            (ref_main + sum(v for _, v in terms)).backward()
            close(loss, ref_main.item(), f"step {step} main loss")
            assert_grads_close(pipe, ref, f"step {step}")
            losses = pipe.last_step_losses()
            close(losses["loss"], ref_main.item(), "breakdown loss")
            close(losses["aux"], sum(v.item() for _, v in terms), "breakdown aux")
            for name in ("z", "balance"):
                close(losses[f"aux/{name}"], sum(v.item() for n, v in terms if n == name), f"aux/{name}")
            pipe.zero_grad()

    return check


def frozen(schedule: str) -> Check:
    """A frozen first stage, a float mask and int ids that need no grad crossing stages, LoRA on frozen bases."""

    def check(ctx: Ctx) -> None:
        layers, m = frozen_model(), 3
        stages = ctx.world * (2 if schedule == "zb-v" else 1)
        rest = sw.partition.partition_costs([1.0] * 7, stages - 1).counts
        pipe = pipeline(ctx, layers, F.cross_entropy, schedule, m, partition=[1, *rest])
        ref = sw.build_model(layers)
        two_mlp_steps(pipe, ref, m)

    return check


def batchnorm(schedule: str) -> Check:
    """BatchNorm in a stage normalises each micro-batch with its own statistics (GPipe's behaviour) and updates
    the running statistics once per micro-batch, in micro-batch order: the one-process model run micro-batch by
    micro-batch, with the losses weighted by size, gives the same gradients and buffers."""

    def check(ctx: Ctx) -> None:
        layers, m = bn_model(), 4
        pipe = pipeline(ctx, layers, F.cross_entropy, schedule, m)
        ref = sw.build_model(layers)
        for step in range(2):
            x, y = mlp_data(4 * m, seed=step)
            loss = pipe.train_step(x, y)
            ref.zero_grad()
            total = 0.0
            for xi, yi in zip(x.chunk(m), y.chunk(m)):
                li = F.cross_entropy(ref(xi), yi) * (len(yi) / len(y))
                li.backward()
                total += li.item()
            close(loss, total, f"step {step} loss")
            assert_grads_close(pipe, ref, f"step {step}")
            pipe.zero_grad()
        ref_state = ref.state_dict()
        for k, v in pipe.state_dict().items():
            torch.testing.assert_close(v, ref_state[k], rtol=RTOL, atol=ATOL, msg=lambda s, k=k: f"{k}: {s}")

    return check


def memory(schedule: str, how: Any = None) -> Check:
    """Peak bytes saved for backward on each rank, measured, against the simulator fed the measured per-stage
    activation bytes of one micro-batch."""

    def check(ctx: Ctx) -> dict[str, Any]:
        m = 2 * ctx.world
        layers = gelu_mlp(2 * ctx.world * 2)
        pipe = pipeline(ctx, layers, F.cross_entropy, schedule, m, recompute=how, measure_memory=True)
        x, y = mlp_data(4 * m, seed=0)
        pipe.train_step(x, y)
        report = pipe.memory_report()
        everyone = gather_objects(report["forward_bytes"], ctx.group)
        per_stage: dict[int, set[int]] = {}
        for d in everyone:
            for (s, _), b in d.items():
                per_stage.setdefault(s, set()).add(b)
        assert all(len(v) == 1 for v in per_stage.values()), f"micro-batches of one stage differ: {per_stage}"
        stage_bytes = [float(next(iter(per_stage[s]))) for s in range(pipe.schedule.num_stages)]
        # what I leaves for W (the rest of the stage's graph is freed by I), measured per micro-batch
        per_stage = {}
        for d in gather_objects(report["weight_bytes"], ctx.group):
            for (s, _), b in d.items():
                per_stage.setdefault(s, set()).add(b)
        assert all(len(v) == 1 for v in per_stage.values()), f"W-held bytes of one stage differ: {per_stage}"
        weight_bytes = [float(next(iter(per_stage.get(s, {0})))) for s in range(pipe.schedule.num_stages)]
        costs = sw.CostModel.uniform(pipe.schedule.num_stages)
        costs = dataclasses.replace(
            costs, activation_bytes=tuple(stage_bytes), weight_activation_bytes=tuple(weight_bytes)
        )
        predicted = sw.simulate(pipe.schedule, costs).peak_activation_bytes[pipe.rank]
        measured = report["peak_bytes"]
        assert abs(measured - predicted) <= 1e-6 * predicted, f"rank {pipe.rank}: measured {measured}, sim {predicted}"
        mine = [stage_bytes[s] for s in pipe.local_stages]
        micro = 4 * D * 8  # one micro-batch of inputs (4 samples x D float64)
        if pipe.rank == 0 and how is None:
            expect = {"1f1b": min(ctx.world, m), "gpipe": m}.get(schedule)
            if expect is not None:
                assert measured == expect * stage_bytes[0], (measured, expect, stage_bytes[0])
        if pipe.rank == 0 and how == "stage":
            assert stage_bytes[0] == micro, f"recompute keeps the stage input only: {stage_bytes[0]} vs {micro}"
        held = [weight_bytes[s] for s in pipe.local_stages]
        return {
            "measured": measured,
            "simulated": predicted,
            "stage_bytes": mine,
            "weight_bytes": held,
            "input_bytes": micro,
        }

    return check


def autocast(schedule: str) -> Check:
    """bf16 autocast per stage: losses and float32 gradients as the one-process model under the same autocast."""

    def check(ctx: Ctx) -> None:
        layers = [sw.Layer(nn.Linear, D, D) if k % 2 == 0 else sw.Layer(nn.GELU) for k in range(7)]
        layers.append(sw.Layer(nn.Linear, D, CLASSES))
        m = 4
        pipe = pipeline(ctx, layers, F.cross_entropy, schedule, m, autocast=torch.bfloat16)
        ref = sw.build_model(layers)
        for step in range(2):
            x, y = mlp_data(4 * m, seed=step)
            x = x.float()
            loss = pipe.train_step(x, y)
            ref.zero_grad()
            total = 0.0
            for xi, yi in zip(x.chunk(m), y.chunk(m)):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    li = F.cross_entropy(ref(xi), yi) / m
                assert li.dtype == torch.float32
                li.backward()
                total += li.item()
            assert abs(loss - total) <= 1e-2 * abs(total), f"step {step} loss {loss} vs {total}"
            for name, p in pipe.named_parameters():
                assert p.grad is not None and p.grad.dtype == torch.float32, f"{name}: {p.grad}"
            assert_grads_close(pipe, ref, f"step {step}", rtol=1e-2, atol=1e-3)
            pipe.zero_grad()

    return check


class TokenMLP(nn.Module):
    """Per-token layers over (batch, time, D): any sequence length works."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


def pooled_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.mean(dim=1), y)


def variable_shapes(schedule: str) -> Check:
    """Sequences whose length differs per micro-batch and per step (sw.MicroBatches, variable_shapes=True):
    the loss and gradients of the one-process model run on each micro-batch, weighted by its size."""

    def check(ctx: Ctx) -> None:
        layers = [sw.Layer(TokenMLP) for _ in range(2 * ctx.world - 1)]
        layers.append(sw.Layer(nn.Linear, D, CLASSES, dtype=torch.float64))
        m = 4
        pipe = pipeline(ctx, layers, pooled_loss, schedule, m, variable_shapes=True)
        ref = sw.build_model(layers)
        g = torch.Generator().manual_seed(5)
        for step in range(3):
            sizes = [2 + (k + step) % 3 for k in range(m)]  # uneven micro-batches
            lengths = [3 + (5 * k + 2 * step) % 7 for k in range(m)]
            xs = [torch.randn(n, t, D, generator=g, dtype=torch.float64) for n, t in zip(sizes, lengths)]
            ys = [torch.randint(0, CLASSES, (n,), generator=g) for n in sizes]
            loss = pipe.train_step(sw.MicroBatches(xs), sw.MicroBatches(ys))
            ref.zero_grad()
            total = sum(sizes)
            ref_loss = sum(pooled_loss(ref(x), y) * (len(y) / total) for x, y in zip(xs, ys))
            ref_loss.backward()
            close(loss, ref_loss.item(), f"step {step} loss")
            assert_grads_close(pipe, ref, f"step {step}")
            pipe.zero_grad()

    return check


def checks(world: int) -> dict[str, Check]:
    out: dict[str, Check] = {}
    for s in SCHEDULES:
        out[f"tied-{s}"] = tied(s)
        out[f"recompute-stage-{s}"] = recompute(s, "stage")
        out[f"clip-{s}"] = clip(s)
        out[f"aux-{s}"] = aux(s)
        if s != "interleaved-1f1b":  # the frozen model's explicit partition is one stage per rank
            out[f"frozen-{s}"] = frozen(s)
    out["tied-gpipe"] = tied("gpipe")
    out["recompute-2-zb-v"] = recompute("zb-v", 2)
    out["recompute-1-1f1b"] = recompute("1f1b", 1)
    out["aux-recompute-zb-h1"] = aux("zb-h1", "stage")
    out["aux-dualpipe-v"] = aux("dualpipe-v")
    for s in ("1f1b", "zb-h1"):
        out[f"autocast-{s}"] = autocast(s)
    for s in ("1f1b", "zb-v"):
        out[f"variable-shapes-{s}"] = variable_shapes(s)
    for s in ("1f1b", "zb-v"):
        out[f"batchnorm-{s}"] = batchnorm(s)
    for s, how in (
        ("1f1b", None),
        ("gpipe", None),
        ("zb-h1", None),
        ("zb-v", None),
        ("1f1b", "stage"),
        ("gpipe", "stage"),
    ):
        out[f"memory-{s}" + ("" if how is None else f"-recompute-{how}")] = memory(s, how)
    out["memory-tp"] = memory_tp
    if world > 2:  # keep the 4-rank job short: the features under the three named schedules
        keep = (
            "tied-",
            "aux-1f1b",
            "aux-zb-v",
            "frozen-",
            "variable-shapes-zb-v",
            "recompute-stage-zb-h1",
            "recompute-2",
            "clip-zb-v",
            "memory-",
        )
        out = {k: v for k, v in out.items() if k.startswith(keep) and k != "tied-gpipe"}
    out.update(metrics_checks.checks(world))  # issue 50's metrics=, in this job too
    out.update(owned_checks.checks(world))
    if world == 4:  # issue 42's, in this job rather than a torchrun start of their own
        out.update(merge_checks.checks(world))
    out.update(dropout_checks.checks(world))
    return out
