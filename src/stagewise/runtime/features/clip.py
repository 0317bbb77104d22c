"""Clipping the gradients of a whole pipelined model: one norm over every stage and mesh axis, one collective.

Kept apart from :mod:`..hybrid` and light to import: :meth:`Pipeline.clip_grad_norm_` is a collective, and a
first call that imported torch's tensor-parallel and FSDP modules (seconds on a loaded machine, more on
some ranks than others) made the ranks that came first wait in the all-reduce for the ones still
importing - past the pipeline's timeout, on a busy 2-core machine (issue 17: the "first clip stall").
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from ..comm.collectives import all_reduce

Reduce = Callable[[torch.Tensor, str], None]


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: a DTensor's local shard (no DTensor exists unless its module was imported)."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    return t.to_local() if dtensor is not None and isinstance(t, dtensor.DTensor) else t


def grad_norm(
    grads: Sequence[torch.Tensor],
    norm_type: float,
    copies: Callable[[torch.Tensor], int],
    reduce: Reduce,
    device: torch.device,
) -> float:
    """The ``norm_type``-norm of every gradient element of the model, each counted once.

    ``grads`` are this rank's; ``copies(g)`` says on how many ranks the same
    piece lives (its contribution is divided by that), ``reduce(t, op)`` sums
    (or maxes) over all ranks, on ``device``.
    """
    norm_type = float(norm_type)
    if norm_type <= 0:
        raise ValueError(f"norm_type must be positive (or inf), got {norm_type}")
    if math.isinf(norm_type):
        acc = torch.zeros(1, dtype=torch.float64, device=device)
        for g in grads:
            if _local(g).numel():
                acc = torch.maximum(acc, _local(g).detach().abs().max().to(torch.float64))
        reduce(acc, "max")
        return float(acc.item())
    acc = torch.zeros(1, dtype=torch.float64, device=device)
    for g in grads:
        part = _local(g).detach().to(torch.float64)
        acc += part.abs().pow(norm_type).sum() / copies(g)
    reduce(acc, "sum")
    return float(float(acc.item()) ** (1.0 / norm_type))


def clip_grad_norm_(
    params: Iterable[nn.Parameter],
    max_norm: float,
    norm_type: float,
    copies: Callable[[torch.Tensor], int],
    reduce: Reduce,
    device: torch.device,
) -> float:
    """Scale the gradients so that the model's total norm is at most ``max_norm``; returns the norm before.

    The same rule as ``torch.nn.utils.clip_grad_norm_`` on the one-process
    model: ``g *= min(1, max_norm / (norm + 1e-6))``.
    """
    grads = [p.grad for p in params if p.grad is not None]
    total = grad_norm(grads, norm_type, copies, reduce, device)
    coef = min(1.0, max_norm / (total + 1e-6))
    with torch.no_grad():
        for g in grads:
            _local(g).mul_(coef)
    return total


def clip_pipeline_grads(pipe: Any, max_norm: float, norm_type: float) -> float:
    """:meth:`Pipeline.clip_grad_norm_`: over the mesh's axes, or the pipeline group (one copy of each stage)."""
    hybrid = pipe.hybrid
    params = list(pipe.parameters())
    if hybrid is not None:  # a tied parameter counts once over its copies on the mesh and across stages
        copies = lambda g: hybrid.copies(g) * pipe.tied.copies(g, params)  # noqa: E731
        reduce = hybrid.reduce
    else:
        copies = lambda g: pipe.tied.copies(g, params)  # noqa: E731 (a tied parameter counts once)
        reduce = lambda t, op: all_reduce(t, pipe.transport.group, op, pipe.transport.guard.wait, "the gradient norm")  # noqa: E731
    total = clip_grad_norm_(pipe.parameters(), max_norm, norm_type, copies, reduce, pipe.device)
    pipe.metrics.grad_norm(total)  # in the step's metrics (or the step just finished, clipped between steps)
    return total
