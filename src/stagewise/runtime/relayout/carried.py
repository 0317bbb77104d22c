"""What a re-layout carries beside the tensors (the learning-rate schedule, ``lr_scheduler=``), and what it
tells the user's own objects (an optimizer over the old parameters is refused; listeners learn the layout).

The pipeline's schedulers step in lockstep, one per stage's optimizer, so one state describes them all (a
checkpoint saves the first one's, :func:`stagewise.checkpoint.save`). The re-layout takes it from a process that
holds a part in the agreement's exchange and loads it into every scheduler of the new stages, after their
optimizers took their hyper-parameters back: the warm-up goes on where it was, as a resume would."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..checkpoint import state
from ..checkpoint.declared import PipelineState
from ..errors import PipelineError


def scheduler_state(pipe: Any) -> Any:
    """The state of ``pipe``'s own schedulers (JSON, as a checkpoint records it), or None (none, or no pipe)."""
    return state.scheduler_state(pipe)


def restore_schedulers(pipe: Any, saved: Any) -> None:
    """Load ``saved`` (:func:`scheduler_state`) into every scheduler of ``pipe``."""
    state.restore_scheduler(pipe, saved)


def carry_snapshots(old: Any, new: Any) -> None:
    """``snapshot=``: the new layout's snapshotter goes on from the old one's step, under the job's name (a resume
    chooses the newest step: one counted from 0 again would lose the steps before), and the old one is given up
    (its files stay: the resume reads them until the new layout's replace them)."""
    before = old.snapshots if isinstance(old, PipelineState) else None
    after = new.snapshots if isinstance(new, PipelineState) else None
    if before is None:
        return
    before.finish_at_exit()  # (the copy in flight ends; a failure of it is a warning: the commit point is past)
    if after is not None:
        after.step, after.job = before.step, before.job
        after.committed = max(after.committed, before.committed)  # (a step between snapshots: still the old one's)
    before.forget()


# ---- what the user holds: optimizers of their own, samplers of their own ---------------------------------
_retired: dict[int, weakref.ref[torch.Tensor]] = {}  # id -> a parameter of a layout a re-layout replaced
_hooked: list[Any] = []  # the global optimizer-step hook, once installed
_listeners: list[Callable[[Any], None]] = []


def retire(params: Iterable[torch.Tensor], kept: Iterable[torch.Tensor]) -> None:
    """The old layout's parameters (but those the new one holds as they are): an optimizer of the user's that
    still holds one is refused at its next ``step()`` (its updates would go to tensors nobody trains)."""
    held = {id(p) for p in kept}
    for p in params:
        if id(p) not in held:
            _retired[id(p)] = weakref.ref(p, _forget(id(p)))
    if not _hooked:
        _hooked.append(register_optimizer_step_pre_hook(_refuse_retired))


def _refuse_retired(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if not _retired:
        return
    stale = sum(1 for g in optimizer.param_groups for p in g["params"] if _is_retired(p))
    if stale:
        raise PipelineError(
            f"this {type(optimizer).__name__} holds {stale} parameters of the layout before a pipe.relayout(): "
            "they are no longer trained. Build it again over pipe.parameters() after each re-layout (its state "
            "starts over), or give the Pipeline optimizer= (a factory): its optimizers move with their state"
        )


def _forget(key: int) -> Callable[[Any], None]:
    def forget(_: Any) -> None:
        _retired.pop(key, None)

    return forget


def _is_retired(p: torch.Tensor) -> bool:
    ref = _retired.get(id(p))
    return ref is not None and ref() is p


def on_relayout(listener: Callable[[Any], None]) -> Callable[[], None]:
    """Call ``listener(layout)`` on this process after each re-layout it takes part in (a sampler of one's own
    re-reads who holds the first and last stages: ``layout.inputs_at`` / ``layout.targets_at``); returns a
    function that removes it."""
    _listeners.append(listener)
    return lambda: _listeners.remove(listener) if listener in _listeners else None


def tell(layout: Any) -> None:
    """Tell the listeners of :func:`on_relayout` the new layout."""
    for listener in list(_listeners):
        listener(layout)
