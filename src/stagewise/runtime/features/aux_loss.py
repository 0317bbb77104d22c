"""Auxiliary losses: a layer anywhere in the model adds a scalar to the loss (MoE load balancing, z-loss).

Roughly: inside a layer's forward, ``sw.aux_loss(value)`` records ``value``
(a scalar tensor, the micro-batch's mean) for the stage that is running. The
Pipeline collects a stage's terms around its forward, scales their sum by
``1/m`` (each micro-batch's share of a batch cut into equal micro-batches) and
ties it to the stage's outputs with an identity autograd function whose
backward feeds the sum a gradient of one. So the term is back-propagated by the
stage's own backward (B, or I/W), in every schedule, without the interpreter
knowing: the one-process equivalent is ``loss_fn(out, y) + sum of the terms``
computed on the whole batch (:func:`collect_aux_losses` records them there).
With micro-batches of unequal sizes each micro-batch still weighs ``1/m``.

Outside a collector (evaluation, a plain module call) ``aux_loss`` does nothing.

In a pipeline the collector is :class:`AuxTotals`: it wraps each stage's forward (:meth:`AuxTotals.forward`)
and, as a part of every train step (:class:`~stagewise.runtime.engine.runner.StepPart`), starts the step's
totals afresh and reads them once at its end (``Pipeline.last_step_losses``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..engine.tree import flatten, unflatten

if TYPE_CHECKING:
    from ..engine.run import Run
    from ..engine.stage import Forward

_TERMS: ContextVar[list[tuple[str, torch.Tensor]] | None] = ContextVar("stagewise_aux_terms", default=None)


def aux_loss(value: torch.Tensor, name: str = "aux") -> torch.Tensor:
    """Add ``value`` (a scalar tensor) to the training loss; returns it unchanged."""
    terms = _TERMS.get()
    if terms is not None:
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            raise ValueError(f"aux_loss {name!r} must be a scalar tensor, got {getattr(value, 'shape', value)!r}")
        terms.append((name, value.reshape(())))
    return value


@contextmanager
def collect_aux_losses() -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Record the ``(name, value)`` of every :func:`aux_loss` called inside the block."""
    terms: list[tuple[str, torch.Tensor]] = []
    token = _TERMS.set(terms)
    try:
        yield terms
    finally:
        _TERMS.reset(token)


class _Carry(torch.autograd.Function):
    """Identity on ``xs``; the backward gives ``aux`` a gradient of one."""

    @staticmethod
    def forward(ctx: Any, aux: torch.Tensor, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.like = aux
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (torch.ones((), dtype=ctx.like.dtype, device=ctx.like.device), *grads)


def attach(out: Any, total: torch.Tensor, stage: int) -> Any:
    """``out`` with ``total`` riding on its tensors that require grad (so their backward reaches it)."""
    tensors, spec = flatten(out)
    idx = [k for k, t in enumerate(tensors) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not idx:
        raise ValueError(f"stage {stage} added an aux loss, but none of its outputs requires grad to carry it back")
    carried = _Carry.apply(total, *[tensors[k] for k in idx])
    for k, t in zip(idx, carried):
        tensors[k] = t
    return unflatten(spec, tensors)


class AuxTotals:
    """The aux terms of this rank's stages: carried on each stage's outputs, and totalled over a train step.

    ``scale``: each micro-batch's weight, ``1/m``. :attr:`last`: the last train step's total of each term over
    this rank's stages (one host read, at the step's end).
    """

    def __init__(self, scale: float) -> None:
        self.scale = scale
        self.totals: dict[int, dict[str, Any]] = {}  # stage -> name -> a 0-dim tensor, on the device
        self.last: dict[str, float] = {}

    def forward(self, stage: int, inner: Forward) -> Forward:
        """Stage ``stage``'s forward ``inner`` with the aux terms its layers add collected, totalled and carried."""

        def run(modules: Sequence[nn.Module], x: Any) -> Any:
            if not torch.is_grad_enabled():
                return inner(modules, x)
            with collect_aux_losses() as terms:
                out = inner(modules, x)
            if not terms:
                return out
            mine = self.totals.setdefault(stage, {})
            for name, value in terms:  # kept on the device: read once, at the step's end
                mine[name] = mine.get(name, 0.0) + value.detach() * self.scale
            total = torch.stack([v for _, v in terms]).sum() * self.scale
            return attach(out, total, stage)

        return run

    @contextmanager
    def around(self, run: Run) -> Iterator[None]:
        if run.mode == "train":
            self.totals = {}
        yield

    def after(self, run: Run) -> None:
        """Each aux term's total over this rank's stages (one host read for all of them)."""
        if run.mode != "train":
            return
        totals: dict[str, Any] = {}
        for stage in sorted(self.totals):
            for n, v in self.totals[stage].items():
                totals[n] = totals.get(n, 0.0) + v
        if not totals:
            self.last = {}
            return
        values = torch.stack([torch.as_tensor(v, dtype=torch.float64).reshape(()) for v in totals.values()])
        self.last = dict(zip(totals, values.tolist()))
