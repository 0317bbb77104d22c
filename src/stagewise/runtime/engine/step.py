"""One step's data: the mini-batch cut into micro-batches where it is needed, each loss weighted by its share."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .interpreter import Step
from .microbatch import Dims, split


def prepare_step(
    mode: str,
    inputs: Any,
    targets: Any,
    *,
    rank: int,
    placement: Sequence[int],
    num_microbatches: int,
    batch_dims: tuple[Dims, Dims],
    device: torch.device,
    has_loss: bool,
    loss_weights: Callable[[Any], Any] | None = None,
) -> Step:
    """The :class:`Step` of ``rank``: inputs where stage 0 is, targets and loss weights where the last stage is.

    Each micro-batch's mean loss is weighted by its share of the batch: of the rows, or of
    ``loss_weights(targets)`` summed over the micro-batches (e.g. non-ignored tokens; see :mod:`..losses`).
    """
    m = num_microbatches
    first, last = placement[0], placement[-1]
    step = Step(mode, None, None, None)
    sizes = None
    if rank == first:
        if inputs is None:
            raise ValueError(f"rank {rank} holds stage 0, so {mode}_step needs the inputs")
        chunks, sizes = split(inputs, m, batch_dims[0], "inputs")
        step.inputs = [to_device(c, device) for c in chunks]
    if mode == "train" and rank == last:
        if targets is None:
            raise ValueError(f"rank {rank} holds the last stage, so train_step needs the targets")
        if not has_loss:
            raise ValueError("train_step needs a loss: build the Pipeline with loss_fn=...")
        chunks, target_sizes = split(targets, m, batch_dims[1], "targets")
        if sizes is not None and sizes != target_sizes:
            raise ValueError(f"inputs and targets disagree on the batch size: {sum(sizes)} vs {sum(target_sizes)}")
        step.targets = [to_device(c, device) for c in chunks]
        counts = target_sizes if loss_weights is None else [_count(loss_weights, c, i) for i, c in enumerate(chunks)]
        total = sum(counts)
        if total <= 0:
            raise ValueError(f"loss_weights counted nothing to average over in the whole batch: {counts}")
        step.weights = [n / total for n in counts]
    return step


def _count(loss_weights: Callable[[Any], Any], targets: Any, i: int) -> float:
    """``loss_weights`` of micro-batch ``i``'s targets, checked: a finite number >= 0."""
    n = loss_weights(targets)
    n = float(n.item() if isinstance(n, torch.Tensor) else n)
    if not n >= 0 or n == float("inf"):
        raise ValueError(f"loss_weights returned {n} for micro-batch {i}: expected a count >= 0")
    return n


def to_device(value: Any, device: torch.device) -> Any:
    """``value`` (tensors inside tuples, named tuples, lists and dicts) moved to ``device``."""
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, (tuple, list)):
        moved = [to_device(v, device) for v in value]
        if isinstance(value, list):
            return moved
        return type(value)(*moved) if hasattr(value, "_fields") else tuple(moved)
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    return value
