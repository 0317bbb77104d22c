"""Evaluation on 2 gloo ranks (float64), the ways a user's evaluation went wrong (the evaluation pass of
2026-12-07): a second evaluation of another size (a DataLoader's short last batch) failed the pipeline for good,
as did inputs refused where stage 0 runs; under ``torch.inference_mode()`` the next train step failed ("Inplace
update to inference tensor"). (``eval_loss`` without targets on the last stage's rank, which left the other rank
waiting out its timeout, is checked in one process: tests/runtime/test_eval_loss.py.)

    torchrun --standalone --nproc-per-node 2 tests/distributed/workers/worker.py --checks eval_checks --out DIR
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import stagewise as sw
from worker import Check, Ctx, raises

D, BATCH, M = 6, 8, 2


def _layers() -> list[sw.Layer]:
    return [sw.Layer(nn.Linear, D, D, dtype=torch.float64) for _ in range(4)]


def _pipeline(ctx: Ctx, timeout: float = 60.0) -> sw.Pipeline:
    return sw.Pipeline(
        _layers(), loss_fn=F.mse_loss, microbatches=M, seed=3, group=ctx.group, timeout=timeout,
        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
    )  # fmt: skip


def _data(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(BATCH, D, dtype=torch.float64, generator=g), torch.randn(
        BATCH, D, dtype=torch.float64, generator=g
    )


def _step(pipe: sw.Pipeline, ref: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    """A train step of the pipeline and of the one-process model: the same loss."""
    x, y = _data(seed)
    loss = pipe.train_step(x, y)
    ref_loss = F.mse_loss(ref(x), y)
    ref_loss.backward()
    opt.step()
    opt.zero_grad()
    assert abs(loss - ref_loss.item()) <= 1e-12, f"train_step {loss} vs {ref_loss.item()}"


def inference_mode(ctx: Ctx) -> dict[str, Any]:
    """An evaluation under ``torch.inference_mode()`` (before and between steps), then steps that train as in one
    process: the transport's buffers made during the evaluation are no inference tensors."""
    pipe, ref = _pipeline(ctx), sw.build_model(_layers(), seed=3)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(2):
        x, y = _data(step)
        with torch.inference_mode():
            got = pipe.eval_loss(x, y)
            want = F.mse_loss(ref(x), y).item()
        assert abs(got - want) <= 1e-12, f"step {step}: eval_loss {got} vs {want}"
        _step(pipe, ref, opt, step)
    return {"transport": type(pipe.transport).__name__}


def sizes(ctx: Ctx) -> dict[str, Any]:
    """Evaluations of any size, one after another, each as in one process; inputs refused (fewer samples than
    micro-batches, another dtype than training's) raise on every rank and leave the pipeline usable: it
    evaluates and trains on as the one-process model does."""
    pipe, ref = _pipeline(ctx), sw.build_model(_layers(), seed=3)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    first, last = pipe.schedule.placement[0], pipe.schedule.placement[-1]

    def evaluate(n: int) -> None:
        g = torch.Generator().manual_seed(n)
        x, y = torch.randn(n, D, dtype=torch.float64, generator=g), torch.randn(n, D, dtype=torch.float64, generator=g)
        out = pipe.eval_step(x if pipe.rank == first else None)  # the others may be given nothing
        with torch.no_grad():
            want = ref(x)
        if pipe.rank == last:
            torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12, msg=f"eval_step of {n}")
        got = pipe.eval_loss(x, y)
        assert abs(got - F.mse_loss(want, y).item()) <= 1e-12, f"eval_loss of {n}: {got}"

    _step(pipe, ref, opt, 0)
    for n in (BATCH, 5, 13, M, 5):  # a DataLoader's batches, its short last one, a test set's
        evaluate(n)
    refusals = {
        "too few": (torch.zeros(1, D, dtype=torch.float64), "2 micro-batches need at least 2 samples"),
        "dtype": (torch.zeros(4, D, dtype=torch.float32), "the inputs differ from training's"),
    }
    said = {}
    for what, (x, words) in refusals.items():
        here = words if pipe.rank == first else [f"rank {first}, which holds stage 0, refused the inputs: ", words]
        said[what] = raises(ValueError, here, lambda x=x: pipe.eval_step(x))
    evaluate(7)
    _step(pipe, ref, opt, 1)
    evaluate(BATCH)
    return {"said": said}


def checks(world: int) -> dict[str, Check]:
    return {"sizes": sizes, "inference-mode": inference_mode}
