"""A BatchNorm layer's statistics under ``batchnorm="deferred"`` (:mod:`.batchnorm`): per-channel moments, merged.

Each micro-batch's inputs give a count, a mean and a sum of squared deviations per channel (float64); merged
with Chan, Golub and LeVeque's pairwise update they are the moments of the whole batch, and :func:`commit` applies
them as one ``BatchNorm`` call in training mode on the concatenated inputs would. :func:`sum_over_replicas` makes
them the moments over every data-parallel replica (``across_replicas=True``) with two sums.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.modules.batchnorm import _BatchNorm


@dataclass
class Moments:
    """Per-channel count, mean and sum of squared deviations (M2) of the values seen, in float64."""

    n: int
    mean: torch.Tensor
    m2: torch.Tensor

    @staticmethod
    def zeros(channels: int, device: torch.device | str = "cpu") -> Moments:
        z = torch.zeros(channels, dtype=torch.float64, device=device)
        return Moments(0, z, z.clone())

    @staticmethod
    def of(x: torch.Tensor) -> Moments:
        """The moments of a BatchNorm input ``(N, C, *)`` per channel (dim 1)."""
        dims = [0, *range(2, x.dim())]
        x = x.detach()
        if x.dtype not in (torch.float32, torch.float64):
            x = x.float()  # half types: var_mean in float32, then float64 like the rest
        var, mean = torch.var_mean(x, dim=dims, correction=0)
        n = x.numel() // max(x.shape[1], 1)
        return Moments(n, mean.to(torch.float64), var.to(torch.float64) * n)

    def add(self, other: Moments) -> None:
        """Merge ``other`` in (Chan et al.'s pairwise update): exactly the moments of both sets together."""
        if other.n == 0:
            return
        if self.n == 0:
            self.n, self.mean, self.m2 = other.n, other.mean.clone(), other.m2.clone()
            return
        n = self.n + other.n
        delta = other.mean - self.mean
        self.mean = self.mean + delta * (other.n / n)
        self.m2 = self.m2 + other.m2 + delta * delta * (self.n * other.n / n)
        self.n = n

    def unbiased_var(self) -> torch.Tensor:
        """The variance with Bessel's correction over the whole count (what BatchNorm's running_var averages)."""
        return self.m2 / max(self.n - 1, 1)


def combine(parts: Sequence[Moments]) -> Moments:
    """The moments of the union of ``parts`` (all with the same channel count)."""
    out = Moments.zeros(parts[0].mean.numel(), parts[0].mean.device)
    for p in parts:
        out.add(p)
    return out


@torch.no_grad()
def commit(bn: _BatchNorm, stats: Moments) -> None:
    """Update ``bn``'s running statistics with one batch's moments, as ``bn(batch)`` in training mode would."""
    if stats.n == 0 or bn.running_mean is None or bn.running_var is None:
        return
    if bn.num_batches_tracked is not None:
        bn.num_batches_tracked.add_(1)
    if bn.momentum is None:  # cumulative moving average
        factor = 1.0 / float(bn.num_batches_tracked) if bn.num_batches_tracked is not None else 0.0
    else:
        factor = float(bn.momentum)
    for buf, value in ((bn.running_mean, stats.mean), (bn.running_var, stats.unbiased_var())):
        buf.copy_(buf.to(torch.float64) * (1.0 - factor) + value.to(buf.device) * factor)


def sum_over_replicas(parts: list[Moments], reduce: Callable[[torch.Tensor], Any]) -> None:
    """Make each of ``parts`` the moments of its layer over every replica (``reduce`` sums a tensor in place).

    Two sums: counts and sums give the global mean; then each replica's M2 plus
    ``n (mean - global mean)^2``, summed, gives the global M2 (no cancellation).
    """
    if not parts:
        return
    sizes = [p.mean.numel() for p in parts]
    first = torch.cat([torch.tensor([float(p.n) for p in parts], dtype=torch.float64, device=parts[0].mean.device)])
    first = torch.cat([first, *(p.mean * p.n for p in parts)])
    reduce(first)
    counts = [int(round(c)) for c in first[: len(parts)].tolist()]
    means = [s / max(n, 1) for s, n in zip(first[len(parts) :].split(sizes), counts)]
    second = torch.cat([p.m2 + p.n * (p.mean - g) ** 2 for p, g in zip(parts, means)])
    reduce(second)
    for p, n, g, m2 in zip(parts, counts, means, second.split(sizes)):
        p.n, p.mean, p.m2 = n, g, m2.clone()
