"""Why a stage's forward or its loss failed, in the user's terms, when torch's words do not say.

Each hint is read only once the operation has failed (or, for :func:`crossed_batches`, once at the first loss),
and returns "" when its cause is not the one at hand: torch's own words are then the story.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .tree import flatten


def _first_tensor(value: Any, keep: Callable[[torch.Tensor], bool] = lambda t: True) -> torch.Tensor | None:
    """The first tensor leaf of ``value`` that ``keep`` accepts (what the message names), or None."""
    return next((t for t in flatten(value)[0] if isinstance(t, torch.Tensor) and keep(t)), None)


def unequal_batches(out: Any, targets: Any, m: int, stage: int, i: int) -> str:
    """When the loss failed on an output and targets of unequal batch sizes, why that is likely: the rank holding
    stage 0 and the rank holding the last stage were given different batches (each splits its own into ``m``);
    "" when the sizes agree (the loss's own words are the story then)."""
    x, y = (_first_tensor(v, lambda t: t.dim() > 0) for v in (out, targets))
    if x is None or y is None or x.shape[0] == y.shape[0]:
        return ""
    a, b = x.shape[0], y.shape[0]
    return (
        f"stage {stage}, micro-batch {i}: the model's output holds {a} samples and the targets {b}: the ranks were "
        f"given different batches (about {a * m} inputs on the rank holding stage 0, {b * m} targets here, in {m} "
        "micro-batches)? Give every rank the same global batch, or its own share of it with pipe.local_batch"
    )


def crossed_batches(out: Any, targets: Any) -> str:
    """Why the loss of a micro-batch is no part of the batch's, when an output and targets with the same batch size
    but not the same number of dims broadcast their batch dims against each other (``(n, 1)`` against ``(n,)``:
    every sample paired with every other, n x n terms), or "". torch warns of the shapes; what it means here is
    that the pipeline's loss is not the one-process loss. Targets that broadcast within the output (per feature,
    ``(1, k)``) pair nothing."""
    a, b = (_first_tensor(v) for v in (out, targets))
    if a is None or b is None or a.dim() == b.dim() or min(a.dim(), b.dim()) == 0:
        return ""
    if not (a.is_floating_point() and b.is_floating_point()) or not a.shape[0] == b.shape[0] > 1:
        return ""
    try:
        both = torch.broadcast_shapes(a.shape, b.shape)
    except RuntimeError:
        return ""
    if both.numel() <= max(a.numel(), b.numel()):
        return ""
    return (
        f"loss_fn gets an output of shape {tuple(a.shape)} and targets of shape {tuple(b.shape)}, which broadcast to "
        f"{tuple(both)}: every sample is paired with every other of its micro-batch, so a micro-batch's loss is no "
        "part of the whole batch's and the pipeline's loss differs from one process's; give the targets the output's "
        "shape (e.g. targets.view_as(output))"
    )


def unlike_inputs(stage: Any, x: Any) -> str:
    """When stage 0 failed on inputs of another floating dtype than its parameters' (float64 data into a float32
    model: torch says "mat1 and mat2 must have the same dtype"), which to convert; "" otherwise."""
    params = stage.parameters() if isinstance(stage, torch.nn.Module) else ()
    weight = next((p for p in params if p.is_floating_point()), None)
    given = _first_tensor(x, torch.Tensor.is_floating_point)
    if weight is None or given is None or weight.dtype == given.dtype:
        return ""
    return (
        f"stage 0's inputs are {given.dtype} but its parameters {weight.dtype}: convert the inputs "
        f"(x.to({weight.dtype})), or build the layers in {given.dtype} (sw.Layer(nn.Linear, ..., dtype={given.dtype}))"
    )
