"""A matrix cell against its one-process twin: the reference step, the names, the comparison of losses and
parameters step by step."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from helpers.compare import assert_params_close
from matrix_build import M, build, sgd
from matrix_models import POISON, Built
from worker import Ctx


def reference_step(b: Built, x: Any, y: Any, opt: torch.optim.Optimizer, micro: bool = False) -> float:
    """One step of the one-process model: the whole batch at once, or (``micro``: BatchNorm's cells) micro-batch
    by micro-batch, each loss weighted by its share, as the pipeline runs them."""
    assert b.ref is not None
    opt.zero_grad(set_to_none=True)
    if not micro:
        loss = b.loss_fn(b.ref(x), y)
        loss.backward()
        opt.step()
        return float(loss)
    total = 0.0
    for xk, yk in zip(x.tensor_split(M), y.tensor_split(M)):
        part = b.loss_fn(b.ref(xk), yk) * (len(yk) / len(y))
        part.backward()
        total += float(part)
    opt.step()
    return total


def ref_named(b: Built, pipe: Any) -> nn.Module:
    """The twin whose parameter names are the pipeline's (from_stages names its stages ``stage{s}``)."""
    assert b.ref is not None
    renamed = getattr(b.ref, "renamed", None)
    return b.ref if renamed is None else renamed(pipe.num_ranks)


def train_compare(
    b: Built, what: str, steps: int = 2, micro: bool = False, tol: float = 1e-10, optimizer: Any = sgd
) -> list[float]:
    """Train ``steps`` steps on the pipeline and the twin (``optimizer``: the factory both step with); the losses
    and every parameter must agree."""
    pipe = b.pipe
    opt = optimizer(list(b.ref.parameters()))  # type: ignore[union-attr]
    losses = []
    for step in range(steps):
        x, y = b.data(step)
        loss = pipe.train_step(*pipe.local_batch(x, y))
        want = reference_step(b, x, y, opt, micro)
        assert abs(loss - want) <= tol * (1 + abs(want)), f"{what} step {step}: loss {loss} vs {want}"
        assert_params_close(pipe, ref_named(b, pipe), f"{what} after step {step}", aliases=True)
        losses.append(loss)
    assert abs(losses[-1] - losses[0]) > 1e-6, f"{what}: the loss did not move; the check would not see a bad update"
    return losses


def exact(row: str, column: str, ctx: Ctx) -> dict[str, Any]:
    b = build(row, column, ctx)
    return {"losses": train_compare(b, f"{row} x {column}")}


# ---- columns with more to check ------------------------------------------------------------------
def _poisoned(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A NaN in the first sample's inputs; token ids cannot hold one, so there a label marks the batch (whose
    loss :func:`matrix_models.hf_loss` makes NaN)."""
    if not x.is_floating_point():
        y = y.clone()
        y[0, -1] = POISON
        return x, y
    bad = x.clone()
    bad[0, 0] = float("nan")
    return bad, y
