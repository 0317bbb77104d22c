"""One step's data: the mini-batch cut into micro-batches where it is needed, each loss weighted by its share."""

from __future__ import annotations

from collections.abc import Sequence
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
) -> Step:
    """The :class:`Step` of ``rank``: inputs where stage 0 is, targets and loss weights where the last stage is."""
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
        total = sum(target_sizes)
        step.weights = [n / total for n in target_sizes]
    return step


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
