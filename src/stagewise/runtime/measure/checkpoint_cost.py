"""What checkpointing a segment costs: a line through timed segments, fitted once per profile.

Each layer's ``checkpoint_forward`` / ``checkpoint_backward`` (:mod:`.layer_cost`) is what checkpointing it
alone adds to its forward, and to its backward beyond running the forward again. A recomputed stage is one
segment, so the planner charges it a line in the tensors the segment saves
(:class:`~stagewise.partition.CheckpointCost`): :func:`with_checkpoint_cost` fits it through the layers'
points and through chains of tiny products (:func:`checkpoint_chains`), which pin it where layers cluster.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import replace

import torch
from torch.utils.checkpoint import checkpoint

from ...partition import CheckpointCost, LayerProfile
from ..engine.backward import backward_full
from .layer_cost import Timer, timer


def with_checkpoint_cost(measured: LayerProfile) -> LayerProfile:
    """``measured`` with what a checkpointed segment costs (:class:`~stagewise.partition.CheckpointCost`): the
    least-squares line, in the tensors a segment saves, through every segment timed - each layer checkpointed
    alone, and chains of 1 and 17 products (:func:`checkpoint_chains`), which pin the line where layers cluster.
    A stage is one segment: its extra is the line at the sum of its layers' saved tensors."""
    device = torch.device(measured.device)
    points = checkpoint_chains(device, repeats=max(measured.repeats, 15), warmup=max(measured.warmup, 2))
    points += [(x.saved_tensors, x.checkpoint_forward, x.checkpoint_backward) for x in measured.layers]
    fixed_f, per_f = _line([(n, f) for n, f, _ in points])
    fixed_b, per_b = _line([(n, b) for n, _, b in points])
    return replace(measured, checkpoint=CheckpointCost(fixed_f, fixed_b, per_f, per_b))


def _line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Intercept and slope of the least-squares line (the chains' two sizes make it defined), neither below zero:
    these are differences of small times, and a falling line is noise (then the mean, flat)."""
    xs, ys = [x for x, _ in points], [y for _, y in points]
    slope, intercept = statistics.linear_regression(xs, ys)
    if slope < 0:
        slope, intercept = 0.0, statistics.fmean(ys)
    return max(0.0, intercept), slope


CHAINS = (1, 17)  # products per checkpointed chain: two saved tensors each


def checkpoint_chains(device: torch.device, *, repeats: int = 15, warmup: int = 2) -> list[tuple[float, float, float]]:
    """Chains of ``k`` products ``a * w`` on tiny tensors, plain and checkpointed: per chain, its saved tensors,
    the forward's extra and the backward's extra beyond the plain backward and the forward again (medians)."""
    timed = timer(device)
    a = torch.ones(8, device=device, requires_grad=True)
    w = torch.ones(8, device=device, requires_grad=True)
    points = []
    for k in CHAINS:

        def run(x: torch.Tensor, k: int = k) -> torch.Tensor:
            for _ in range(k):
                x = x * w
            return x

        rows = []
        for r in range(warmup + repeats):
            tf, tb = _forward_backward(timed, lambda: run(a), a)
            tcf, tcb = _forward_backward(timed, lambda: checkpoint(run, a, use_reentrant=False), a)
            if r >= warmup:
                rows.append((tcf - tf, tcb - tb - tf))
        points.append((2.0 * k, statistics.median(x for x, _ in rows), statistics.median(y for _, y in rows)))
    return points


def _forward_backward(timed: Timer, forward: Callable[[], torch.Tensor], leaf: torch.Tensor) -> tuple[float, float]:
    out, tf = timed(forward)
    _, tb = timed(lambda: backward_full([out], [torch.ones_like(out)], [leaf], fused=False))
    leaf.grad = None
    return tf, tb


__all__ = ["CHAINS", "checkpoint_chains", "with_checkpoint_cost"]
