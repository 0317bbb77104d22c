"""Checks for BatchNorm under micro-batching (issue 18), run on every rank of one torchrun job.

    torchrun --standalone --nproc-per-node 2 tests/distributed/workers/worker.py --checks batchnorm_checks --out DIR

The reference is the one-process model (``sw.build_model``) in float64, run the
way the pipeline runs the batch: micro-batch by micro-batch in training mode
(each normalised with its own statistics; gradients weighted by size), its
buffers then put back, and each BatchNorm layer called once, in training mode,
on the concatenation of the inputs it saw: torch's own running-statistics
update over the whole batch. Also importable in one process (tests/runtime/test_batchnorm.py).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import stagewise as sw
from helpers.compare import ATOL, RTOL, assert_params_close
from helpers.models import Res
from stagewise.runtime.engine.microbatch import split
from worker import Check, Ctx, gather_objects

TIMEOUT = 60.0
D, CLASSES = 16, 5
M, BATCH, STEPS, LR = 4, 14, 3, 0.1  # 14 samples in 4 micro-batches: 4, 4, 3, 3
DEFERRED = sw.runtime.BatchNormPolicy("deferred")


# ---- model ----------------------------------------------------------------------------
class Channels(nn.Module):
    """(N, D) -> BatchNorm1d over 4 channels of length D/4 (a 3-d input: statistics over N and L) -> (N, D)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(4, momentum=0.5, dtype=torch.float64)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(h.reshape(h.shape[0], 4, D // 4)).reshape(h.shape[0], D)


def bn_layers() -> list[sw.Layer]:
    """10 layers, BatchNorm with momentum 0.3, None (cumulative average) and 0.5, one behind another."""
    return [
        sw.Layer(nn.Linear, D, D, dtype=torch.float64),
        sw.Layer(nn.BatchNorm1d, D, momentum=0.3, dtype=torch.float64),
        sw.Layer(nn.GELU),
        sw.Layer(nn.Linear, D, D, dtype=torch.float64),
        sw.Layer(nn.BatchNorm1d, D, momentum=None, dtype=torch.float64),
        sw.Layer(Res),
        sw.Layer(Channels),
        sw.Layer(Res),
        sw.Layer(Res),
        sw.Layer(nn.Linear, D, CLASSES, dtype=torch.float64),
    ]


def late_bn_layers() -> list[sw.Layer]:
    """BatchNorm in the last layers only (the last rank's stage): rank 0 must still say so."""
    head = [sw.Layer(nn.BatchNorm1d, D, dtype=torch.float64), sw.Layer(nn.Linear, D, CLASSES, dtype=torch.float64)]
    return [*(sw.Layer(Res) for _ in range(8)), *head]  # 10 layers: the BatchNorm is on the last stage of 2 or 4


def data(batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, D, generator=g, dtype=torch.float64) * 2.0 + 3.0  # far from normalised
    return x, torch.randint(0, CLASSES, (batch,), generator=g)


# ---- the reference --------------------------------------------------------------------
def batchnorms(model: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def reference_step(
    ref: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    m: int,
    replicas: int = 1,
    policy: sw.runtime.BatchNormPolicy = DEFERRED,
) -> float:
    """One step of the one-process model: its loss; gradients in ``.grad``; the running statistics as ``policy``
    says (deferred: once, over the whole batch's inputs; micro: once per micro-batch).

    With ``replicas``, the batch is first cut in that many equal shares (``Pipeline.local_batch``), each run as
    ``m`` micro-batches; the running statistics cover all of them (``across_replicas=True``), or else each
    replica's, updated from the same start, are averaged (:func:`averaged_update`).
    """
    norms = batchnorms(ref)
    buffers = {k: v.clone() for k, v in ref.named_buffers()}
    seen: dict[int, list[torch.Tensor]] = {id(bn): [] for bn in norms}
    hooks = [bn.register_forward_pre_hook(lambda mod, args: seen[id(mod)].append(args[0].detach())) for bn in norms]
    xs, ys, sizes = [], [], []
    for xr, yr in zip(split(x, replicas)[0], split(y, replicas)[0]):
        chunks, n = split(xr, m)
        xs, ys, sizes = xs + chunks, ys + split(yr, m)[0], sizes + n
    total = 0.0
    try:
        for xi, yi, n in zip(xs, ys, sizes):
            loss = F.cross_entropy(ref(xi), yi) * (n / sum(sizes))
            loss.backward()
            total += loss.item()
    finally:
        for h in hooks:
            h.remove()
    with torch.no_grad():
        for k, v in ref.named_buffers():
            v.copy_(buffers[k])  # undo the per-micro-batch updates
        for bn in norms:
            if bn.training and policy.mode == "deferred" and (policy.across_replicas or replicas == 1):
                bn(torch.cat(seen[id(bn)]))  # torch's update, once, over the whole batch
            elif bn.training:
                averaged_update(bn, seen[id(bn)], replicas, policy.mode)
    return total


def averaged_update(bn: nn.Module, inputs: list[torch.Tensor], replicas: int, mode: str) -> None:
    """torch's own update on each replica's inputs (its ``len(inputs) / replicas`` micro-batches, in order), every
    replica from the same start - ``"micro"``: one call per micro-batch, ``"deferred"``: one on their
    concatenation -, then the replicas' running statistics averaged (``num_batches_tracked``: equal on all)."""
    start = {k: v.clone() for k, v in bn.named_buffers()}
    per, ends = len(inputs) // replicas, []
    for r in range(replicas):
        for k, v in bn.named_buffers():
            v.copy_(start[k])
        mine = inputs[r * per : (r + 1) * per]
        for chunk in mine if mode == "micro" else [torch.cat(mine)]:
            bn(chunk)
        ends.append({k: v.clone() for k, v in bn.named_buffers()})
    for k, v in bn.named_buffers():
        v.copy_(torch.stack([e[k] for e in ends]).mean(0) if v.is_floating_point() else ends[0][k])


def train_and_compare(
    make: Callable[..., sw.Pipeline],
    steps: int = STEPS,
    m: int = M,
    mode: Any = "deferred",
    evaluate: bool = True,
    replicas: int = 1,
    batch: int = BATCH,
    expect: sw.runtime.BatchNormPolicy | None = None,
    **kw: Any,
) -> sw.Pipeline:
    """``steps`` SGD steps of the pipeline and the reference (``expect``: the policy the reference follows, by
    default ``mode``); parameters and buffers compared after each, then (``evaluate``) eval_step's outputs
    against the one-process model's in eval mode."""
    expect = expect or (mode if isinstance(mode, sw.runtime.BatchNormPolicy) else sw.runtime.BatchNormPolicy(mode))
    layers = bn_layers()
    pipe = make(layers, batchnorm=mode, optimizer=lambda ps: torch.optim.SGD(ps, lr=LR), **kw)
    ref = sw.build_model(layers)
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    for step in range(steps):
        x, y = data(batch, seed=step)
        loss = pipe.train_step(*pipe.local_batch(x, y))
        ref_loss = reference_step(ref, x, y, m, replicas, expect)
        opt.step()
        opt.zero_grad()
        assert abs(loss - ref_loss) <= 1e-10 * max(1.0, abs(ref_loss)), f"step {step} loss: {loss} vs {ref_loss}"
        assert_params_close(pipe, ref, f"after step {step}", buffers=True)
    counts = {n: int(b) for n, b in pipe.named_buffers() if n.endswith("num_batches_tracked")}
    per_step = 1 if expect.mode == "deferred" else m
    assert all(c == steps * per_step for c in counts.values()), f"num_batches_tracked {counts}, {per_step} per step"
    if not evaluate:
        return pipe
    pipe.eval()  # eval mode: the running statistics normalise, as in the one-process model
    ref.eval()
    x, _ = data(BATCH, seed=99)
    out = pipe.eval_step(pipe.local_batch(x)[0])
    if out is not None:
        x = pipe.local_batch(x)[0]
        with torch.no_grad():
            torch.testing.assert_close(out, ref(x), rtol=RTOL, atol=ATOL)
    pipe.train()
    return pipe


def reference_update_bn(ref: nn.Module, batches: list[torch.Tensor], m: int, mode: str, replicas: int = 1) -> None:
    """``sw.runtime.update_bn`` in one process, written out: every BatchNorm's statistics estimated again with the
    weights as they are, as the cumulative average of one estimate per batch (``"deferred"``: the mean and the
    unbiased variance over the inputs the layer saw in the batch's micro-batches, each normalised alone) or per
    micro-batch (``"micro"``: torch's own ``update_bn`` over the micro-batches). A micro-batch that gives a layer
    one value per channel (torch refuses to normalise it by its own statistics) is normalised with the running
    statistics as they stand and updates nothing; under ``"deferred"`` its values still count in the estimate."""
    cuts = [[c for share in split(x, replicas)[0] for c in split(share, m)[0]] for x in batches]
    norms = batchnorms(ref)
    seen: dict[int, list[torch.Tensor]] = {id(bn): [] for bn in norms}
    alone: list[nn.Module] = []

    def before(mod: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        seen[id(mod)].append(args[0].detach())
        if args[0].numel() == args[0].shape[1]:
            mod.eval()
            alone.append(mod)

    def after(mod: nn.Module, args: Any, out: Any) -> None:
        if alone and alone[-1] is mod:
            alone.pop().train()

    hooks = [h for bn in norms for h in (bn.register_forward_pre_hook(before), bn.register_forward_hook(after))]
    try:
        if mode == "micro":
            torch.optim.swa_utils.update_bn([c for batch in cuts for c in batch], ref)
            return
        _deferred_estimates(ref, norms, cuts, seen)
    finally:
        for h in hooks:
            h.remove()


@torch.no_grad()
def _deferred_estimates(
    ref: nn.Module, norms: list[Any], cuts: list[list[torch.Tensor]], seen: dict[int, list[torch.Tensor]]
) -> None:
    """The deferred estimates: the forwards use each micro-batch's own statistics and update nothing; after each
    batch every layer's running statistics are the mean of the estimates so far (momentum None)."""
    ref.train()
    estimates: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {id(bn): [] for bn in norms}
    for bn in norms:
        bn.reset_running_stats()
        bn.track_running_stats = False
    try:
        for b, batch in enumerate(cuts):
            for bn in norms:
                seen[id(bn)] = []
            for c in batch:
                ref(c)
            for bn in norms:
                x = torch.cat(seen[id(bn)])
                dims = [0, *range(2, x.dim())]
                estimates[id(bn)].append((x.mean(dims), x.var(dims, correction=1)))
                means, variances = zip(*estimates[id(bn)])
                bn.running_mean.copy_(torch.stack(means).mean(0))
                bn.running_var.copy_(torch.stack(variances).mean(0))
                bn.num_batches_tracked.fill_(b + 1)
    finally:
        for bn in norms:
            bn.track_running_stats = True


def update_bn_and_compare(
    make: Callable[..., sw.Pipeline], mode: Any = "deferred", replicas: int = 1, batch: int = BATCH
) -> None:
    """A step trained, then ``sw.runtime.update_bn`` over three batches (DataLoader-style pairs, the last
    shorter) against :func:`reference_update_bn` on the one-process model: every buffer equal; each layer's
    momentum and every module's mode (one BatchNorm frozen in eval mode) as they were; then a step and an
    evaluation of other sizes."""
    layers = bn_layers()
    pipe = make(layers, batchnorm=mode, optimizer=lambda ps: torch.optim.SGD(ps, lr=LR))
    ref = sw.build_model(layers)
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    x, y = data(batch, seed=0)
    pipe.train_step(*pipe.local_batch(x, y))
    reference_step(ref, x, y, M, replicas)
    opt.step()
    frozen = [name for name, mod in pipe.named_modules() if isinstance(mod, nn.BatchNorm1d)][:1]
    for name in frozen:
        pipe.get_submodule(name).eval()
    before = {n: (mod.training, getattr(mod, "momentum", None)) for n, mod in pipe.named_modules()}
    # a DataLoader's short last one: 5 samples a replica, in micro-batches of 2, 1, 1, 1 (one value per channel)
    batches = [data(batch if k < 2 else 5 * replicas, seed=10 + k) for k in range(3)]
    sw.runtime.update_bn([pipe.local_batch(bx, by) for bx, by in batches], pipe)
    policy = mode if isinstance(mode, str) else mode.mode
    reference_update_bn(ref, [bx for bx, _ in batches], M, policy, replicas)
    assert_params_close(pipe, ref, f"update_bn ({policy})", buffers=True)
    after = {n: (mod.training, getattr(mod, "momentum", None)) for n, mod in pipe.named_modules()}
    assert after == before, "update_bn left a module's mode or a BatchNorm's momentum changed"
    pipe.train_step(*pipe.local_batch(x, y))  # the step's own shapes again, and an evaluation's of its own size
    pipe.eval_step(pipe.local_batch(x)[0])


# ---- checks ---------------------------------------------------------------------------
def deferred(schedule: str, recompute: Any = None) -> Check:
    def check(ctx: Ctx) -> None:
        def make(layers: list, **kw: Any) -> sw.Pipeline:
            return sw.Pipeline(
                layers,
                loss_fn=F.cross_entropy,
                schedule=schedule,
                microbatches=M,
                group=ctx.group,
                timeout=TIMEOUT,
                recompute=recompute,
                **kw,
            )

        train_and_compare(make)

    return check


def micro_fails(ctx: Ctx) -> dict[str, Any]:
    """The mutant: committing once per micro-batch ("micro") must fail the deferred comparison on some rank."""

    def make(layers: list, **kw: Any) -> sw.Pipeline:
        return sw.Pipeline(layers, loss_fn=F.cross_entropy, schedule="1f1b", microbatches=M, timeout=TIMEOUT, **kw)

    failed = False
    try:
        train_and_compare(make, steps=1, mode="micro", evaluate=False, expect=DEFERRED)  # (no communication after)
    except AssertionError:
        failed = True
    everyone = gather_objects(failed, None)
    assert any(everyone), "per-micro-batch running statistics passed the deferred comparison on every rank"
    return {"failed_here": failed}


def detect(ctx: Ctx) -> dict[str, Any]:
    """Two pipelines with BatchNorm only on the last rank, no batchnorm= given: one message (checked by the test)."""
    for _ in range(2):
        sw.Pipeline(late_bn_layers(), loss_fn=F.cross_entropy, schedule="1f1b", microbatches=2, timeout=TIMEOUT)
    sw.Pipeline(late_bn_layers(), loss_fn=F.cross_entropy, microbatches=2, timeout=TIMEOUT, batchnorm="micro")
    return {"rank": ctx.rank}


def replicas(ctx: Ctx) -> None:
    """pp=2 x dp=2 with across_replicas=True: the running statistics of the global batch on every replica."""

    def make(layers: list, **kw: Any) -> sw.Pipeline:
        config = sw.ParallelConfig(pp=2, dp=ctx.world // 2)
        return sw.Pipeline(layers, loss_fn=F.cross_entropy, microbatches=M, parallel=config, timeout=TIMEOUT, **kw)

    policy = sw.runtime.BatchNormPolicy("deferred", across_replicas=True)
    train_and_compare(make, mode=policy, replicas=ctx.world // 2, batch=2 * BATCH)


def replicas_averaged(mode: str) -> Check:
    """pp=2 x dp=2 without ``across_replicas``: each replica's running statistics averaged at every step, so every
    replica holds the same (each compared with the reference) and a checkpoint saves; it was refused as "the
    replicas diverged" before."""

    def check(ctx: Ctx) -> None:
        def make(layers: list, **kw: Any) -> sw.Pipeline:
            config = sw.ParallelConfig(pp=2, dp=ctx.world // 2)
            return sw.Pipeline(layers, loss_fn=F.cross_entropy, microbatches=M, parallel=config, timeout=TIMEOUT, **kw)

        pipe = train_and_compare(make, mode=mode, replicas=ctx.world // 2, batch=2 * BATCH)
        run = os.environ.get("TORCHELASTIC_RUN_ID", "local")
        folder = Path(tempfile.gettempdir()) / f"stagewise-bn-replicas-{mode}-{run}"
        try:
            sw.checkpoint.save(folder, pipe, step=STEPS)
        finally:
            gather_objects(None, None)  # (every rank done with the folder)
            if ctx.rank == 0:
                shutil.rmtree(folder, ignore_errors=True)

    return check


def update_bn(mode: str) -> Check:
    def check(ctx: Ctx) -> None:
        def make(layers: list, **kw: Any) -> sw.Pipeline:
            return sw.Pipeline(layers, loss_fn=F.cross_entropy, microbatches=M, group=ctx.group, timeout=TIMEOUT, **kw)

        update_bn_and_compare(make, mode)

    return check


def update_bn_replicas(ctx: Ctx) -> None:
    """pp=2 x dp=2, across_replicas=True: each estimate over every replica's share of the batch."""

    def make(layers: list, **kw: Any) -> sw.Pipeline:
        config = sw.ParallelConfig(pp=2, dp=ctx.world // 2)
        return sw.Pipeline(layers, loss_fn=F.cross_entropy, microbatches=M, parallel=config, timeout=TIMEOUT, **kw)

    policy = sw.runtime.BatchNormPolicy("deferred", across_replicas=True)
    update_bn_and_compare(make, policy, replicas=ctx.world // 2, batch=2 * BATCH)


FOUR_RANKS = ("1f1b", "zb-v", "interleaved-1f1b", "zb-h1")


def checks(world: int) -> dict[str, Check]:
    out: dict[str, Check] = {"detect": detect}
    names = sw.schedule_names(synchronous=True) if world == 2 else FOUR_RANKS
    for s in names:
        out[f"deferred-{s}"] = deferred(s)
        if world == 2 or s in ("1f1b", "zb-v"):
            out[f"deferred-{s}-recompute"] = deferred(s, "stage")
    out["deferred-zb-h1-recompute-1"] = deferred("zb-h1", 1)
    out["micro-fails"] = micro_fails
    out["update-bn-deferred"], out["update-bn-micro"] = update_bn("deferred"), update_bn("micro")
    if world == 4:
        out["deferred-across-replicas"] = replicas
        out["update-bn-across-replicas"] = update_bn_replicas
        out["micro-replicas-averaged"] = replicas_averaged("micro")
        out["deferred-replicas-averaged"] = replicas_averaged("deferred")
    return out
