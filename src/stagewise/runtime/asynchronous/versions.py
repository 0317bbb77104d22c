"""One stage's weight versions at run time: snapshots the version table names, made and freed when it says.

A forward runs the stage with :func:`torch.func.functional_call` on
*snapshots*: detached copies of the weights of the version it uses, leaves
that require grad. The optimizer updates the live parameters in place at STEP;
the snapshots (and the autograd graphs built on them) are untouched, so a
backward differentiates exactly the version its forward ran on. A backward's
weight gradients land on the snapshot leaves and are added to its
mini-batch's accumulator; at the mini-batch's SYNC the sum becomes the live
parameters' ``.grad``, and STEP steps the optimizer.

Memory: the live parameters, plus one snapshot per version the table keeps
alive (:func:`stagewise.asynchronous.versions.live_versions` counts those, the current
weights included: at run time the current version's snapshot is a copy of
the live parameters, so a rank holds at most one parameter copy more than
the simulator counts).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from ...asynchronous import Version
from ..engine.stage import Stage
from .predict import predict


class _Holder(nn.Module):
    """The stage's modules under one root, so :func:`functional_call` can swap all their parameters at once."""

    def __init__(self, stage: Stage) -> None:
        super().__init__()
        self.layers = nn.ModuleList(stage.modules)
        self.run = stage  # a plain attribute: Stage is not a Module

    def forward(self, x: Any) -> Any:
        return self.run(x)


class VersionedStage:
    """A stage callable that runs on the weights in ``using`` (a snapshot), or on its live parameters when None."""

    def __init__(self, stage: Stage) -> None:
        self.stage = stage
        self.holder = _Holder(stage)
        named = list(self.holder.named_parameters())
        self.names = [n for n, _ in named]
        self.params: list[nn.Parameter] = [p for _, p in named]
        self.using: list[torch.Tensor] | None = None
        self.last_input: Any = None

    @property
    def index(self) -> int:
        return self.stage.index

    def __call__(self, x: Any) -> Any:
        self.last_input = x
        if self.using is None:
            return self.stage(x)
        return functional_call(self.holder, dict(zip(self.names, self.using)), (x,))


class StageVersions:
    """The snapshots, the current version count and the per-mini-batch gradient sums of one stage."""

    def __init__(self, stage: VersionedStage, optimizer: torch.optim.Optimizer | None) -> None:
        self.stage = stage
        self.optimizer = optimizer
        self.current = 0
        self.stored: dict[Version, list[torch.Tensor]] = {}
        self.sums: dict[int, list[torch.Tensor | None]] = {}
        self.peak = 0  # most snapshots held at once (never reset: over all windows)

    def reset(self) -> None:
        """A new window: the weights as they are now are version 0; nothing is stashed."""
        self.current = 0
        self.stored.clear()
        self.sums.clear()

    def weights(self, version: Version) -> list[torch.Tensor]:
        """The snapshot of ``version``, made now from the current weights if it is not kept yet."""
        have = self.stored.get(version)
        if have is not None:
            return have
        if version.base != self.current:
            raise RuntimeError(
                f"stage {self.stage.index} needs weight version {version}, but holds W^({self.current}) and has "
                f"not kept it (kept: {', '.join(map(str, self.stored)) or 'none'})"
            )
        values = predict(self.optimizer, self.stage.params, version.ahead)
        leaves = [v.requires_grad_(p.requires_grad) for v, p in zip(values, self.stage.params)]
        self.stored[version] = leaves
        self.peak = max(self.peak, len(self.stored))
        return leaves

    def release(self, versions: tuple[Version, ...]) -> None:
        for v in versions:
            self.stored.pop(v, None)

    def add(self, minibatch: int, grads: list[torch.Tensor | None]) -> None:
        """Add one backward's weight gradients (one per parameter, None where unused) to its mini-batch's sum."""
        total = self.sums.get(minibatch)
        if total is None:
            self.sums[minibatch] = [None if g is None else g.detach() for g in grads]
            return
        for k, g in enumerate(grads):
            if g is not None:
                total[k] = g.detach() if total[k] is None else total[k] + g  # type: ignore[operator]

    def load_gradient(self, minibatch: int) -> None:
        """SYNC: mini-batch ``minibatch``'s summed gradient becomes the live parameters' ``.grad``."""
        grads = self.sums.pop(minibatch, None) or [None] * len(self.stage.params)
        for p, g in zip(self.stage.params, grads):
            if p.requires_grad:
                p.grad = None if g is None else g.to(p.dtype)

    def before_step(self, keep: bool) -> None:
        """STEP: keep a copy of the version being replaced when a later action still uses it."""
        if keep and Version(self.current) not in self.stored:
            self.weights(Version(self.current))

    def after_step(self) -> None:
        self.current += 1
