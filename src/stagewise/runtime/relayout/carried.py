"""What a re-layout carries beside the tensors: the learning-rate schedule (``lr_scheduler=``).

The pipeline's schedulers step in lockstep, one per stage's optimizer, so one state describes them all (a
checkpoint saves the first one's, :func:`stagewise.checkpoint.save`). The re-layout takes it from a process that
holds a part in the agreement's exchange and loads it into every scheduler of the new stages, after their
optimizers took their hyper-parameters back: the warm-up goes on where it was, as a resume would."""

from __future__ import annotations

from typing import Any

from ..checkpoint import state


def scheduler_state(pipe: Any) -> Any:
    """The state of ``pipe``'s own schedulers (JSON, as a checkpoint records it), or None (none, or no pipe)."""
    schedulers = getattr(pipe, "schedulers", None) or {}
    if not schedulers:
        return None
    return state.encode(schedulers[min(schedulers)].state_dict(), "the LR scheduler's state")


def restore_schedulers(pipe: Any, saved: Any) -> None:
    """Load ``saved`` (:func:`scheduler_state`) into every scheduler of ``pipe``."""
    if saved is None:
        return
    for scheduler in (getattr(pipe, "schedulers", None) or {}).values():
        scheduler.load_state_dict(state.decode(saved))
