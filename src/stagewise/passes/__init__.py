"""Lowering: a compute-only schedule made complete by small passes, each checked by the validator.

* :mod:`.lowering`: the passes (split the backward, add gradient sync, add communication, add optimizer
  steps, forward only) and :func:`lower`, which runs them in order;
* :mod:`.arrays` / :mod:`.reference`: the communication pass on whole arrays (what runs) and written
  plainly, action by action (the fallback that runs when the arrays cannot time an order);
* :mod:`.build`: :func:`build_schedule`, a registered schedule generated and lowered.
"""

from .build import build_schedule
from .lowering import add_communication, add_grad_sync, add_optimizer_steps, forward_only, lower, split_backward

__all__ = [
    "add_communication",
    "add_grad_sync",
    "add_optimizer_steps",
    "build_schedule",
    "forward_only",
    "lower",
    "split_backward",
]
