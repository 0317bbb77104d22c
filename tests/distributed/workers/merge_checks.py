"""Gradient merge (``pipe.no_sync()``, issue 42) on 4 gloo ranks, run by feature_checks.py (its 4-rank job).

Each check merges K train steps into one optimizer step and compares with the one-process model calling
``loss.backward()`` once per batch before one step (float64): pp 2 x dp 2 with tied weights, pp 2 x sharding 2
(FSDP2), each counting the reductions (none in the merged steps, one per stage at the last); the check of
non-finite values on the merged gradient (skip and raise); and what a merge refuses (clipping, checkpoints,
asynchronous schedules).
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import stagewise as sw
import stagewise.runtime.hybrid.sharding as zero
from feature_models import D, gelu_mlp, lm_data, lm_loss, mlp_data, tied_lm
from helpers.compare import assert_grads_close, assert_params_close
from stagewise.runtime.frontends.tied import TiedSync
from stagewise.runtime.hybrid.data_parallel import GradAverager
from worker import Check, Ctx, gather_objects, raises

K, M, LR, TIMEOUT = 3, 2, 0.1, 60.0


def sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR)


#: what starts a reduction: a stage's data-parallel all-reduces, a tied key's sum, a stage's FSDP2 reduce-scatter
REDUCTIONS = ((GradAverager, "start"), (TiedSync, "_start"), (zero, "reduce"))


@contextmanager
def counted() -> Iterator[list[int]]:
    """Count the reductions started inside the block (the calls of :data:`REDUCTIONS`)."""
    calls = [0]
    originals = [(owner, name, getattr(owner, name)) for owner, name in REDUCTIONS]

    def counting(original: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            return original(*args, **kwargs)

        return call

    for owner, name, original in originals:
        setattr(owner, name, counting(original))
    try:
        yield calls
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)


def close(a: float, b: float, what: str) -> None:
    assert abs(a - b) <= 1e-10 * max(1.0, abs(b)), f"{what}: {a} vs {b}"


def merged_group(pipe: sw.Pipeline, batches: list[Any]) -> tuple[list[float], list[int]]:
    """One gradient merge: K - 1 train steps under no_sync, then one outside; the losses and, per step, how many
    reductions it started."""
    losses, counts = [], []
    for k, (x, y) in enumerate(batches):
        with counted() as calls:
            if k < len(batches) - 1:
                with pipe.no_sync():
                    losses.append(pipe.train_step(*pipe.local_batch(x, y)))
                assert pipe.merged_steps == k + 1, (k, pipe.merged_steps)
            else:
                losses.append(pipe.train_step(*pipe.local_batch(x, y)))
                assert pipe.merged_steps == 0
        counts.append(calls[0])
    return losses, counts


def reference_group(ref: nn.Module, batches: list[Any], loss_fn: Any) -> list[float]:
    """The one-process merge: one backward per batch, gradients adding up (the optimizer steps after)."""
    out = []
    for x, y in batches:
        loss = loss_fn(ref(x), y)
        loss.backward()
        out.append(float(loss))
    return out


# ---- exact, every reduction once ------------------------------------------------------------------------
def dp_tied(ctx: Ctx) -> dict[str, Any]:
    """pp 2 x dp 2, a tied embedding / head, the optimizer stepped by the schedule's STEP: two merges of K steps
    equal the one-process model; the merged steps issue no all-reduce (data-parallel or tied) and run no sync
    hook, the last issues them."""
    layers = tied_lm()
    parallel = sw.ParallelConfig(pp=2, dp=2)
    pipe = sw.Pipeline(
        layers, loss_fn=lm_loss, microbatches=M, parallel=parallel, optimizer=sgd, seed=3, timeout=TIMEOUT
    )
    ref = sw.build_model(layers, seed=3)
    opt = sgd(list(ref.parameters()))
    hooked: list[int] = []
    pipe.register_sync_hook(hooked.append)
    counts = []
    for group in range(2):
        batches = [lm_data(8, seed=10 * group + k) for k in range(K)]
        opt.zero_grad(set_to_none=True)
        hooked.clear()
        losses, reductions = merged_group(pipe, batches)
        want = reference_group(ref, batches, lm_loss)
        opt.step()
        for k, (a, b) in enumerate(zip(losses, want)):
            close(a, b, f"merge {group} step {k} loss")
        assert_params_close(pipe, ref, f"after merge {group}")
        assert reductions[:-1] == [0] * (K - 1) and reductions[-1] > 0, reductions
        assert sorted(hooked) == sorted(pipe.local_stages), hooked  # the last step's SYNCs only
        counts.append(reductions)
    return {"reductions per step": counts}


def sharding(ctx: Ctx) -> dict[str, Any]:
    """pp 2 x sharding 2 (FSDP2), the optimizer stepped by the user: the merged gradient (unsharded gradients
    accumulating over the merged steps, an evaluation between them) reduce-scattered once, at the last."""
    layers = gelu_mlp()
    parallel = sw.ParallelConfig(pp=2, sharding=2)
    pipe = sw.Pipeline(layers, loss_fn=F.cross_entropy, microbatches=M, parallel=parallel, timeout=TIMEOUT)
    ref = sw.build_model(layers)
    opt, ref_opt = sgd(list(pipe.parameters())), sgd(list(ref.parameters()))
    counts = []
    for group in range(2):
        batches = [mlp_data(8, seed=20 * group + k) for k in range(K)]
        x, _ = pipe.local_batch(*batches[0])
        with pipe.no_sync():
            pipe.eval_step(x)  # (FSDP reshards after an evaluation: the merge must survive it)
        losses, reductions = merged_group(pipe, batches)
        want = reference_group(ref, batches, F.cross_entropy)
        for k, (a, b) in enumerate(zip(losses, want)):
            close(a, b, f"merge {group} step {k} loss")
        assert_grads_close(pipe, ref, f"merge {group}")
        assert reductions[:-1] == [0] * (K - 1) and reductions[-1] == len(pipe.local_stages), reductions
        opt.step(), ref_opt.step()
        opt.zero_grad(set_to_none=True), ref_opt.zero_grad(set_to_none=True)
        assert_params_close(pipe, ref, f"after merge {group}")
        counts.append(reductions)
    return {"reductions per step": counts}


# ---- non-finite values: checked once, on the merged gradient ---------------------------------------------
class Counter(nn.Module):
    """Tanh, and a buffer counting the rows it saw (a statistic a skipped merge must put back)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("rows", torch.zeros((), dtype=torch.float64))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        self.rows += h.shape[0]
        return torch.tanh(h)


def counted_mlp() -> list[Any]:
    layers = gelu_mlp()
    layers[3] = sw.Layer(Counter)
    return layers


def poisoned(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = mlp_data(8, seed)
    x = x.clone()
    x[1, 0] = float("nan")
    return x, y


def skip(ctx: Ctx) -> dict[str, Any]:
    """nan_policy="skip": a NaN in the second of K merged steps skips the whole merge, once, at its last step
    (no weight moves, the buffers back as its first step found them); the next merge is exact."""
    layers = counted_mlp()
    pipe = sw.Pipeline(layers, loss_fn=F.cross_entropy, microbatches=M, optimizer=sgd, nan_policy="skip")
    ref = sw.build_model(layers)
    opt = sgd(list(ref.parameters()))
    before = {n: t.detach().clone() for n, t in [*pipe.named_parameters(), *pipe.named_buffers()]}
    batches = [mlp_data(8, 0), poisoned(1), mlp_data(8, 2)]
    losses, _ = merged_group(pipe, batches)
    assert pipe.skipped_steps == 1, pipe.skipped_steps
    for n, t in [*pipe.named_parameters(), *pipe.named_buffers()]:
        assert torch.equal(t.detach(), before[n]), f"{n} changed in a skipped merge"
    clean = [mlp_data(8, 10 + k) for k in range(K)]
    merged_group(pipe, clean)
    reference_group(ref, clean, F.cross_entropy)
    opt.step()
    assert_params_close(pipe, ref, "the merge after a skipped one")
    assert pipe.skipped_steps == 1
    return {"losses of the skipped merge": losses}


def raised(ctx: Ctx) -> dict[str, Any]:
    """nan_policy="raise": the merged step with a NaN returns its loss; the merge's last step raises on every rank,
    naming that step, and nothing is stepped; the gradients are dropped, so the next merge is exact."""
    layers = gelu_mlp()
    pipe = sw.Pipeline(layers, loss_fn=F.cross_entropy, microbatches=M, optimizer=sgd, timeout=TIMEOUT)
    ref = sw.build_model(layers)
    opt = sgd(list(ref.parameters()))
    with pipe.no_sync():
        first = pipe.train_step(*poisoned(0))
    words = ["non-finite", "of the gradient merge's step 1", "no optimizer stepped"]
    text = raises(sw.PipelineError, words, lambda: pipe.train_step(*mlp_data(8, 1)))
    assert pipe.merged_steps == 0 and all(p.grad is None for p in pipe.parameters())
    assert_params_close(pipe, ref, "after the refused merge")
    clean = [mlp_data(8, 10 + k) for k in range(K)]
    merged_group(pipe, clean)
    reference_group(ref, clean, F.cross_entropy)
    opt.step()
    assert_params_close(pipe, ref, "the merge after a refused one")
    return {"first loss": first, "error": text.splitlines()[0][:200]}


# ---- refusals -------------------------------------------------------------------------------------------
def refusals(ctx: Ctx) -> None:
    """Inside a merge (and until its last step) clipping and checkpoints are refused on every rank alike; after
    it both run; an asynchronous schedule refuses no_sync."""
    pipe = sw.Pipeline(gelu_mlp(), loss_fn=F.cross_entropy, microbatches=M, timeout=TIMEOUT)
    folder = Path(gather_objects(tempfile.mkdtemp() if ctx.rank == 0 else None, None)[0])
    with pipe.no_sync():
        raises(ValueError, "clip_grad_norm_ inside a gradient merge", lambda: pipe.clip_grad_norm_(1.0))
        pipe.train_step(*mlp_data(8, 0))
    raises(ValueError, "1 train_step accumulated", lambda: pipe.clip_grad_norm_(1.0))
    raises(sw.checkpoint.CheckpointError, "gradient merge", lambda: sw.checkpoint.save(folder, pipe, step=1))
    raises(sw.checkpoint.CheckpointError, "gradient merge", lambda: sw.checkpoint.load(folder, pipe))
    pipe.train_step(*mlp_data(8, 1))
    assert pipe.clip_grad_norm_(1e9) > 0
    sw.checkpoint.save(folder, pipe, step=1)
    stream = sw.Pipeline(gelu_mlp(), loss_fn=F.cross_entropy, schedule="pipedream", optimizer=sgd, timeout=TIMEOUT)
    raises(ValueError, "no_sync() (a gradient merge) is not supported", stream.no_sync)
    gather_objects(None, None)
    if ctx.rank == 0:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)


def checks(world: int) -> dict[str, Check]:
    assert world == 4, "the gradient merge checks run on 4 ranks"
    return {
        "merge-dp-tied": dp_tied,
        "merge-sharding": sharding,
        "merge-nan-skip": skip,
        "merge-nan-raise": raised,
        "merge-refusals": refusals,
    }


__all__ = ["D", "checks"]
