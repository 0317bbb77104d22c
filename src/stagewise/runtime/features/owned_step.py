"""What the pipeline's own optimizers (``optimizer=``) do besides stepping: a scheduler, clipping, and a refusal.

With ``optimizer=`` each stage's optimizer steps at the schedule's STEP and its gradients are cleared there, so
after ``train_step`` no ``.grad`` is left: a user's own optimizer, LR scheduler or ``clip_grad_norm_`` over the
pipeline's parameters would silently do nothing. What the user writes either happens or is refused:

* ``lr_scheduler=factory`` (``optimizer -> LRScheduler``): one scheduler per stage's optimizer, stepped right
  after it (once per train step for a synchronous schedule), as ``opt.step(); sched.step()`` in one process.
  They are ``Pipeline.schedulers`` (stage -> scheduler), saved and loaded by ``sw.checkpoint``.
* ``clip=max_norm``: before the first STEP of each train step, once every gradient is final, the whole model's
  gradient is clipped to that 2-norm (:func:`.clip.clip_pipeline_grads`: one norm over every stage and mesh
  axis, as ``torch.nn.utils.clip_grad_norm_`` on the one-process model).
* an optimizer of the user's stepping parameters these optimizers own is refused on its first step (a global
  pre-step hook of torch's optimizers), naming ``optimizer=``; so is ``Pipeline.clip_grad_norm_`` after a step.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ...schedules import is_asynchronous
from ..engine.hooks import AfterStep, OnDevice, Stepper, step_needs
from ..engine.run import Run
from .clip import clip_pipeline_grads

SchedulerFactory = Callable[[torch.optim.Optimizer], Any]


def check_owned_step(optimizer: Any, lr_scheduler: Any, clip: Any) -> None:
    """``lr_scheduler=`` is a factory, ``clip=`` a norm > 0; both act on the pipeline's own optimizers."""
    if lr_scheduler is not None and not callable(lr_scheduler):
        raise TypeError(f"lr_scheduler must be a factory optimizer -> LR scheduler, got {lr_scheduler!r}")
    if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float)) or not clip > 0):
        raise ValueError(f"clip must be a gradient norm > 0 (the max_norm of clip_grad_norm_), got {clip!r}")
    for name, value in (("lr_scheduler", lr_scheduler), ("clip", clip)):
        if value is not None and optimizer is None:
            how = "a scheduler of your own steps after train_step" if name == "lr_scheduler" else (
                "without it, call pipe.clip_grad_norm_(max_norm) after train_step, before your optimizer steps"
            )  # fmt: skip
            raise ValueError(
                f"{name}= acts on the pipeline's own optimizers: it needs optimizer=, a factory params -> "
                f"Optimizer ({how})"
            )


def schedulers_per_stage(
    optimizers: Mapping[int, torch.optim.Optimizer], factory: SchedulerFactory | None
) -> dict[int, Any]:
    """One scheduler per stage's optimizer (``lr_scheduler=``), or none."""
    if factory is None:
        return {}
    out = {s: factory(opt) for s, opt in sorted(optimizers.items())}
    for scheduler in out.values():
        missing = step_needs(scheduler)
        if missing:
            raise ValueError(
                f"lr_scheduler=: {type(scheduler).__name__}.step() needs {', '.join(missing)}, which the pipeline "
                "cannot give: each stage's scheduler steps at its STEP, before the step's loss is known. Build one "
                "per pipe.optimizers[stage] yourself and step it after train_step with the loss it returns (or "
                "your validation loss); sw.checkpoint.save(..., scheduler=[...]) keeps them"
            )
    return out


class Scheduled:
    """A stepper that steps each stage's scheduler right after its optimizer (where the optimizer steps). A
    scheduler that raises (``OneCycleLR`` past its ``total_steps``) raises after the stage stepped: the train
    step ends on every rank before its error is raised (:class:`~..engine.hooks.AfterStep`)."""

    def __init__(self, inner: Stepper | None, schedulers: Mapping[int, Any]) -> None:
        self.inner: Stepper = inner if inner is not None else OnDevice()
        self.schedulers = schedulers

    def step(self, stage: int, optimizer: torch.optim.Optimizer) -> None:
        self.inner.step(stage, optimizer)
        scheduler = self.schedulers.get(stage)
        if scheduler is not None:
            try:
                scheduler.step()
            except Exception as err:
                raise AfterStep(stage, err) from err


class ClipPart:
    """``clip=``: at the first STEP of each train step (every gradient final: ``settle()``), the whole model's
    gradient clipped to ``max_norm`` (a collective). A :class:`~..engine.hooks.StagePart` and a
    :class:`~..engine.runner.StepPart`. The schedule puts the STEPs at the end of each rank's list."""

    def __init__(self, pipe: Any, max_norm: float, settle: Callable[[], None]) -> None:
        self.pipe = pipe  # the Pipeline (its parameters, tied copies, mesh, transport)
        self.max_norm = float(max_norm)
        self.settle = settle
        self.clipped = True  # nothing to clip outside a train step

    @contextmanager
    def around(self, run: Any) -> Iterator[None]:
        if run.mode == "train":
            self.clipped = False
        yield

    def after(self, run: Any) -> None:
        """(Clipping happened at the step's first STEP.)"""

    def on_sync(self, run: Run, stage: int) -> None:
        """Nothing at SYNC: the gradients are not final yet."""

    def before_step(self, run: Run, stage: int) -> None:
        if self.clipped or run.accumulate:  # (a gradient merge's step only accumulates: no STEP steps)
            return
        self.clipped = True
        self.settle()
        clip_pipeline_grads(self.pipe, self.max_norm, 2.0)


def clip_part(pipe: Any, max_norm: float | None, tied: Any, hybrid: Any) -> ClipPart | None:
    """``clip=``'s part (None without it): it settles the tied sums and the hybrid axes' reductions first."""
    if max_norm is None:
        return None

    def settle() -> None:
        tied.finish()
        if hybrid is not None:
            hybrid.wait_reductions()

    return ClipPart(pipe, max_norm, settle)


def clip_between_steps(pipe: Any, merge: Any, max_norm: float, norm_type: float) -> float:
    """:meth:`Pipeline.clip_grad_norm_`: refused inside a gradient merge (the merged gradient is not reduced yet)
    and with ``optimizer=`` (the STEP already stepped and cleared the gradients: ``clip=`` clips before it)."""
    why = "clipping belongs to the optimizer step, on the merged gradient, whose reductions have not run"
    merge.refuse("clip_grad_norm_", why)
    if pipe.options.optimizer is not None and is_asynchronous(pipe.schedule):
        raise ValueError(
            f"clip_grad_norm_ after train_stream does nothing with asynchronous schedule {pipe.schedule.name!r}: "
            "each stage's optimizer stepped at its STEPs and cleared its gradients, and clip= is refused too (the "
            "stages step at different times: no moment holds the whole model's gradient of one mini-batch); to "
            "bound each stage's own gradient, clip in the optimizer= factory's optimizer, before its step"
        )
    if pipe.options.optimizer is not None:
        raise ValueError(
            "clip_grad_norm_ after train_step does nothing with optimizer=: each stage's optimizer stepped at the "
            "schedule's STEP and cleared its gradients; pass clip=max_norm to the Pipeline (clipped before the "
            "step, over the whole model)"
        )
    return clip_pipeline_grads(pipe, max_norm, norm_type)


# ---- a user's optimizer stepping what the pipeline's optimizers own ---------------------------------------
_owned: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
_own_optimizers: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
_checked: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
_hook: list[Any] = []


def guard_owned(optimizers: Mapping[int, torch.optim.Optimizer]) -> None:
    """Remember ``optimizers`` and their parameters: another optimizer stepping any of them is refused."""
    for opt in optimizers.values():
        _own_optimizers.add(opt)
        for group in opt.param_groups:
            for p in group["params"]:
                _owned[id(p)] = p
    if optimizers and not _hook:
        _hook.append(register_optimizer_step_pre_hook(_before_user_step))


def _before_user_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if optimizer in _own_optimizers or optimizer in _checked:
        return
    owned = sum(1 for g in optimizer.param_groups for p in g["params"] if _owned.get(id(p)) is p)
    if owned:
        raise ValueError(
            f"{type(optimizer).__name__}.step(): {owned} of its parameters belong to a Pipeline built with "
            "optimizer=, whose own per-stage optimizers step them at the schedule's STEP and clear their "
            "gradients, so this step would do nothing. Either drop optimizer= and step your optimizer after "
            "train_step, or keep it and pass lr_scheduler= (a factory optimizer -> scheduler) and clip= "
            "(a max norm) to the Pipeline; its optimizers are Pipeline.optimizers"
        )
    _checked.add(optimizer)
