"""What SYNC and STEP actions do for a stage: one object, composed of the parts that take part.

At SYNC a stage's gradients are final: tied modules sum theirs over their
owners, the hybrid axes start their reductions, and user hooks run. At STEP
the stage's optimizer steps, after the reductions it needs have finished: on
the device, or through a stepper that moves the update elsewhere
(``offload="optimizer"``: :mod:`..features.offload`). While ``deferring()``
(a gradient merge: :mod:`..features.merge`) the gradients are not final: the
parts skip their reductions themselves, and neither the user's hooks nor the
optimizer run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch


class StagePart(Protocol):
    """A part of the pipeline with work at a stage's SYNC and before its optimizer STEP."""

    def on_sync(self, stage: int) -> None: ...
    def before_step(self, stage: int) -> None: ...


class Stepper(Protocol):
    """Steps a stage's optimizer (its gradients final)."""

    def step(self, stage: int, optimizer: torch.optim.Optimizer) -> None: ...


class OnDevice:
    """The optimizer steps where its parameters are."""

    def step(self, stage: int, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()


class StageHooks:
    """The SYNC and STEP handlers of one rank: ``parts`` in order, then the user's hooks, then the optimizer."""

    def __init__(
        self, parts: list[StagePart], optimizers: dict[int, torch.optim.Optimizer], stepper: Stepper | None = None
    ) -> None:
        self.parts = parts
        self.optimizers = optimizers
        self.stepper: Stepper = stepper if stepper is not None else OnDevice()
        self.user: list[Callable[[int], None]] = []
        self.deferring: Callable[[], bool] = _never  # a gradient merge's steps that only accumulate

    def sync(self, stage: int) -> None:
        for part in self.parts:
            part.on_sync(stage)
        if self.deferring():
            return
        for hook in self.user:
            hook(stage)

    def step(self, stage: int) -> None:
        for part in self.parts:
            part.before_step(stage)
        opt = self.optimizers.get(stage)
        if opt is not None and not self.deferring():
            self.stepper.step(stage, opt)
            opt.zero_grad(set_to_none=True)


def _never() -> bool:
    return False


def optimizer_per_stage(
    modules: dict[int, list[Any]],
    factory: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer] | None,
    stage_parameters: Callable[[list[Any], set[int]], list[torch.nn.Parameter]],
) -> dict[int, torch.optim.Optimizer]:
    """One optimizer per stage that has trainable parameters, so each STEP action steps its own stage."""
    if factory is None:
        return {}
    out = {}
    seen: set[int] = set()  # a module tied between two local stages is stepped by the first
    for s, mods in sorted(modules.items()):
        params = stage_parameters(mods, seen)
        if params:
            out[s] = factory(params)
    return out
