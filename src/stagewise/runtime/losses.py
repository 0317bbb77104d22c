"""Token-level losses whose mean is over the whole batch, however the tokens fall over the micro-batches.

A pipeline computes one loss per micro-batch. With ``loss_fn`` returning the
micro-batch's mean and each mean weighted by the micro-batch's share of the
batch *rows* (the default), the step's loss is the mean over rows. A causal
LM's loss is a mean over *tokens* that are not ignored (``-100`` labels:
padding, prompts), and micro-batches hold different numbers of them: weighting
by rows would then over-count the tokens of sparse micro-batches. So the
Pipeline takes ``loss_weights=count`` (a function of one micro-batch's
targets): micro-batch ``i``'s mean loss is weighted ``count_i / sum(count)``,
which makes the step's loss and gradients the mean over every counted token of
the batch::

    pipe = sw.Pipeline(layers, loss_fn=sw.causal_lm_loss, loss_weights=sw.count_tokens, ...)

A micro-batch with no counted token gets weight 0; its loss must then be
finite (:func:`causal_lm_loss` returns 0 for it, not ``0 / 0``).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100


def check_loss_fn(loss_fn: Any) -> None:
    """Refuse, at construction, a ``loss_fn`` the first step would fail on: not callable, a loss *class*
    (``nn.CrossEntropyLoss``, whose call builds a module instead of a loss), or a function that cannot be called
    as ``loss_fn(output, target)`` (read from its signature, where Python can tell it)."""
    if loss_fn is None:
        return
    if isinstance(loss_fn, type):
        name = f"nn.{loss_fn.__name__}" if issubclass(loss_fn, nn.Module) else loss_fn.__qualname__
        raise TypeError(
            f"loss_fn={name} is the class; pass an instance, loss_fn={name}(), or a function such as "
            "F.cross_entropy (it is called as loss_fn(output, target) and returns the micro-batch's mean loss)"
        )
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be a function (output, target) -> mean loss, got {loss_fn!r}")
    try:
        signature = inspect.signature(loss_fn)
    except (TypeError, ValueError):  # no signature to read (some builtins): the first step will tell
        return
    try:
        signature.bind(None, None)
    except TypeError as err:
        raise TypeError(
            f"loss_fn {_name(loss_fn)} cannot take two positional arguments ({err}): it is called as "
            "loss_fn(output, target), output being the last stage's output for a micro-batch and target that "
            "micro-batch's targets, and returns the micro-batch's mean loss"
        ) from None


def _name(fn: Any) -> str:
    return f"{getattr(fn, '__qualname__', type(fn).__qualname__)}{inspect.signature(fn)}"


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Hugging Face's causal-LM loss: position ``t`` predicts ``labels[:, t + 1]``; mean over non-ignored targets.

    ``logits``: ``(batch, seq, vocab)``; ``labels``: ``(batch, seq)``, ``ignore_index`` where no loss is taken.
    Half-precision logits are upcast to float32 first (as transformers does); float64 stays float64. With no
    target left the loss is 0 (its weight under :func:`count_tokens` is 0 too).
    """
    if logits.dim() != 3 or labels.shape != logits.shape[:2]:
        raise ValueError(
            f"causal_lm_loss needs logits (batch, seq, vocab) and labels (batch, seq); got logits "
            f"{tuple(logits.shape)} and labels {tuple(labels.shape)}"
        )
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    shifted = labels[:, 1:]
    total = F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.size(-1)),
        shifted.reshape(-1),
        ignore_index=ignore_index,
        reduction="sum",
    )
    return total / (shifted != ignore_index).sum().clamp(min=1)


def count_tokens(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """How many targets :func:`causal_lm_loss` averages over in ``labels`` (the ``loss_weights`` for it), as a
    0-dim tensor on the labels' device: the pipeline reads the counts once per step, not once per micro-batch."""
    return (labels[:, 1:] != ignore_index).sum()
