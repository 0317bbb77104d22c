"""What SYNC and STEP actions do for a stage: one object, composed of the parts that take part.

At SYNC a stage's gradients are final: tied modules sum theirs over their
owners, the hybrid axes start their reductions, and user hooks run. At STEP
the stage's optimizer steps, after the reductions it needs have finished: on
the device, or through a stepper that moves the update elsewhere
(``offload="optimizer"``: :mod:`..features.offload`). While the run only
accumulates (``run.accumulate``: a gradient merge, :mod:`..features.merge`) the
gradients are not final: the parts skip their reductions themselves, and
neither the user's hooks nor the optimizer run. Both are handlers of the
interpreter's table (``handler(run, action)``), registered by the assembly.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ...ir import Action, Kind

if TYPE_CHECKING:
    from .compute import Handler
    from .run import Run


class StagePart(Protocol):
    """A part of the pipeline with work at a stage's SYNC and before its optimizer STEP, in the run ``run``."""

    def on_sync(self, run: Run, stage: int) -> None: ...
    def before_step(self, run: Run, stage: int) -> None: ...


class Stepper(Protocol):
    """Steps a stage's optimizer (its gradients final)."""

    def step(self, stage: int, optimizer: torch.optim.Optimizer) -> None: ...


class AfterStep(Exception):
    """What follows a stage's optimizer step (its LR scheduler) raised ``error``: the stage stepped, so the train
    step runs to its end on every rank and raises ``error`` then, the pipeline whole, as ``opt.step();
    sched.step()`` in one process leaves its step taken."""

    def __init__(self, stage: int, error: Exception) -> None:
        super().__init__(f"stage {stage}: {error}")
        self.stage = stage
        self.error = error


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

    def handlers(self) -> dict[Kind, Handler]:
        """This part of the interpreter's table."""
        return {Kind.SYNC: self.sync, Kind.STEP: self.step}

    def sync(self, run: Run, a: Action) -> None:
        stage = a.stage
        for part in self.parts:
            part.on_sync(run, stage)
        if run.accumulate:
            return
        for hook in self.user:
            hook(stage)

    def step(self, run: Run, a: Action) -> None:
        stage = a.stage
        for part in self.parts:
            part.before_step(run, stage)
        opt = self.optimizers.get(stage)
        if opt is not None and not run.accumulate:
            try:
                self.stepper.step(stage, opt)
            except AfterStep as late:
                run.late.append(late)
            opt.zero_grad(set_to_none=True)


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
            _steps_alone(out[s])
    return out


def _steps_alone(optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer whose step needs a closure (LBFGS): each stage steps alone, mid-schedule, where no
    closure can evaluate the model again."""
    if "closure" in step_needs(optimizer):
        raise ValueError(
            f"optimizer=: {type(optimizer).__name__}.step() needs a closure that evaluates the model again, which "
            "a pipeline cannot give (each stage steps alone, at its STEP in the schedule); use an optimizer that "
            "steps from the gradients (SGD, Adam, AdamW, ...)"
        )


def step_needs(stepped: Any) -> list[str]:
    """The arguments ``stepped.step()`` cannot go without (a plateau scheduler's metric, LBFGS's closure)."""
    try:
        signature = inspect.signature(stepped.step)
    except (AttributeError, TypeError, ValueError):  # (no step, or one inspect cannot read: left to run)
        return []
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [q.name for q in signature.parameters.values() if q.default is q.empty and q.kind in kinds]
