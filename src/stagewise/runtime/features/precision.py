"""Mixed precision: each stage's forward (and the loss) under ``torch.autocast``, as in one process.

Roughly: with ``Pipeline(..., autocast=torch.bfloat16)`` a stage's layers run
under ``torch.autocast(device_type, bfloat16)``, so what a stage sends is in the
dtype its last op produced (bf16 for a linear layer: activations travel in the
compute dtype, and their gradients come back in it); ``loss_fn`` runs under
the same autocast, where torch keeps losses such as ``cross_entropy`` in
float32. Backward runs outside autocast, as torch recommends; parameters and
their gradients keep their own dtype (float32 weights get float32 gradients).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

AUTOCAST_DTYPES = (torch.bfloat16, torch.float16)


def check_autocast(dtype: torch.dtype | None) -> None:
    if dtype is not None and dtype not in AUTOCAST_DTYPES:
        raise ValueError(f"autocast must be None, torch.bfloat16 or torch.float16, got {dtype}")


def autocast_context(dtype: torch.dtype | None, device: torch.device) -> Callable[[], Any]:
    """A factory of contexts: autocast to ``dtype`` on ``device``'s type, or nothing."""
    if dtype is None:
        return contextlib.nullcontext
    return lambda: torch.autocast(device.type, dtype=dtype)


def autocast_loss(loss_fn: Callable[..., torch.Tensor] | None, context: Callable[[], Any]) -> Any:
    """``loss_fn`` run under ``context`` (None stays None)."""
    if loss_fn is None or context is contextlib.nullcontext:
        return loss_fn

    def loss(out: Any, target: Any) -> torch.Tensor:
        with context():
            return loss_fn(out, target)

    return loss
