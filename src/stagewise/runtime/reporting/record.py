"""A train step's numbers, from what this rank already holds: no collective, no read of the device.

Roughly, for one run of this rank's action list (``events``: ``(action, start, end)`` in ``perf_counter``
seconds, a compute action starting when its input arrived)::

    step_time = end of the run - its start            (the loss shared too)
    compute   = sum of F, B, I, W                     (Kind.is_compute)
    transfer  = sum of SEND / RECV posting            (Kind.is_comm)
    sync_step = sum of SYNC, STEP and the rest        (gradient reductions, the optimizer)
    waiting   = step_time - the three                 (waiting for a neighbour's value, or the loss)
    bubble    = 1 - compute / step_time               (this rank's idle share)

Samples come from the batch this rank holds (stage 0's inputs or the last stage's targets; a middle rank holds
neither and writes none); tokens are the elements of integer token ids (targets, else inputs) of two or more
dims. The job's loss is alike on every rank (the runner shares it).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from ...ir import Action
from ..engine.microbatch import Dims, batch_size, input_ids_of


def step_times(events: Iterable[tuple[Action, float, float]], step_time: float) -> dict[str, float]:
    """``time/compute``, ``time/transfer``, ``time/sync_step``, ``time/waiting`` (seconds) and ``bubble``."""
    compute = transfer = other = 0.0
    for action, start, end in events:
        if action.kind.is_compute:
            compute += end - start
        elif action.kind.is_comm:
            transfer += end - start
        else:
            other += end - start
    waiting = max(0.0, step_time - compute - transfer - other)
    bubble = 1.0 - compute / step_time if step_time > 0 else 0.0
    return {
        "time/step": step_time,
        "time/compute": compute,
        "time/transfer": transfer,
        "time/sync_step": other,
        "time/waiting": waiting,
        "bubble": bubble,
    }


def batch_counts(
    inputs: Sequence[Any] | None, targets: Sequence[Any] | None, dims: tuple[Dims, Dims]
) -> dict[str, int]:
    """``samples`` and ``tokens`` of the micro-batches this rank holds (empty on a middle rank)."""
    out: dict[str, int] = {}
    for held, dim, what in ((targets, dims[1], "targets"), (inputs, dims[0], "inputs")):
        if not held or any(mb is None for mb in held):
            continue
        if "samples" not in out:
            out["samples"] = sum(batch_size(mb, dim, what) for mb in held)
        ids = [_token_ids(mb) for mb in held]
        if "tokens" not in out and all(t is not None for t in ids):
            out["tokens"] = sum(int(t.numel()) for t in ids if t is not None)
    return out


def _token_ids(value: Any) -> torch.Tensor | None:
    """The token ids of a micro-batch: an integer tensor of at least 2 dimensions, alone, first in a tuple
    (``(input_ids, attention_mask)``) or a tokenizer's dict's ``input_ids``; None for anything else."""
    value = input_ids_of(value)
    if isinstance(value, torch.Tensor) and value.dim() >= 2 and not (value.is_floating_point() or value.is_complex()):
        return value
    return None


def learning_rate(optimizers: Iterable[torch.optim.Optimizer]) -> float | None:
    """The first parameter group's learning rate of the first optimizer (a float; a tensor lr is read as one)."""
    for opt in optimizers:
        for group in opt.param_groups:
            lr = group.get("lr")
            if lr is not None:
                return float(lr)
    return None


def parameter_bytes(params: Iterable[torch.Tensor]) -> int:
    """Bytes of this rank's parameters, each tensor once (a DTensor's local shard)."""
    seen: set[int] = set()
    total = 0
    for p in params:
        local = p.to_local() if hasattr(p, "to_local") else p
        if id(local) not in seen:
            seen.add(id(local))
            total += local.numel() * local.element_size()
    return total
