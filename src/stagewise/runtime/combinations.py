"""Which options combine: every combination stagewise cannot run exactly is refused here, by name.

The checks are pure in the options, the schedule and (for ties) what the frontend built, so every rank
raises alike, before any rank communicates: the schedule is resolved, and these run, before the mesh's
process groups exist. Each message names the way in, the schedule and the options that clash, and what
to do instead. The combination matrix in the docs lists what is exact and what is refused here.

Asynchronous schedules (PipeDream, 2BW, XPipe) step each stage at its own STEPs, so:

* they need ``optimizer=`` (a factory: each stage applies its own optimizer);
* ``recompute=`` is refused: a checkpointed segment would recompute on the live weights, not the stashed
  version its forward used;
* ``nan_policy="skip"`` is refused: the stages step at different times, so no mini-batch can be skipped on
  every rank before the first of them has stepped (``"raise"`` checks every stage at each of its STEPs);
* ``parallel=`` with ``tp`` or ``sharding`` is refused: weight snapshots of split or sharded parameters are
  not implemented (``dp`` is supported);
* tied modules are refused: their copies on two stages would step at different times;
* ``xpipe`` needs an optimizer with a prediction rule (SGD with momentum, Adam, AdamW).

``snapshot=`` (:mod:`.elastic`) needs ``optimizer=`` (a snapshot holds the pipeline's own optimizers, and
their step waits for its copy), a synchronous schedule, and whole tensors (``tp`` and ``sharding`` refused).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..ir import Schedule
from ..schedules import is_asynchronous
from ..validate import async_table

if TYPE_CHECKING:
    from .frontends.parts import Parts
    from .options import Options


def refuse_options(entry: str, options: Options, schedule: Schedule) -> None:
    """What ``options`` cannot do with ``schedule`` (checked before the mesh is built)."""
    if options.snapshot is not None:
        refuse_snapshot(entry, options, schedule)
    if not is_asynchronous(schedule):
        return
    name = f"{entry} with asynchronous schedule {schedule.name!r}"
    if options.optimizer is None:
        raise ValueError(
            f"{name} needs optimizer=..., a factory params -> Optimizer: each stage applies its own optimizer "
            "at its STEP actions"
        )
    if options.recompute is not None:
        raise ValueError(
            f"{name}: recompute= is not supported: a checkpointed segment would recompute on the live weights, "
            "not the weight version its forward used"
        )
    if options.nan_policy == "skip":
        raise ValueError(
            f"{name}: nan_policy='skip' is not supported: the stages step at different times, so a mini-batch "
            "cannot be skipped on every rank before the first of them has stepped; use nan_policy='raise' "
            "(every stage checks its gradients at each of its STEPs) or None"
        )
    config: Any = getattr(options.parallel, "config", options.parallel)  # a Mesh carries its ParallelConfig
    if config is not None and (config.tp > 1 or config.sharding > 1):
        raise ValueError(
            f"{name}: parallel= supports pp and dp only, got tp={config.tp}, sharding={config.sharding}: "
            "weight snapshots of split or sharded parameters are not implemented"
        )
    table = async_table(schedule)
    if table is not None and table.policy == "predict":
        from .asynchronous.predict import check_predictable

        check_predictable(options.optimizer([nn.Parameter(torch.zeros(1))]))


def refuse_snapshot(entry: str, options: Options, schedule: Schedule) -> None:
    """``snapshot=`` keeps what a synchronous step leaves: the pipeline's own optimizers' state, whole tensors."""
    name = f"{entry} with snapshot={options.snapshot!r}"
    if options.optimizer is None:
        raise ValueError(
            f"{name} needs optimizer=, a factory params -> Optimizer: a snapshot holds the pipeline's own "
            "optimizers' state, and holds the optimizer step until its copy of the parameters is taken"
        )
    if is_asynchronous(schedule):
        raise ValueError(
            f"{name}: asynchronous schedule {schedule.name!r} is not supported: its stages step at different "
            "times, so no moment holds one step's state on every rank"
        )
    config: Any = getattr(options.parallel, "config", options.parallel)
    if config is not None and (config.tp > 1 or config.sharding > 1):
        raise ValueError(
            f"{name}: parallel= supports pp and dp only, got tp={config.tp}, sharding={config.sharding}: "
            "snapshots of split or sharded parameters are not implemented (sw.checkpoint.save handles them)"
        )


def refuse_parts(entry: str, options: Options, schedule: Schedule, parts: Parts) -> None:
    """What the built stages cannot do with ``schedule`` (ties are known once the frontend has cut the model)."""
    if is_asynchronous(schedule) and parts.tied is not None and parts.tied.first:
        keys = ", ".join(sorted(parts.tied.first))
        raise ValueError(
            f"{entry} with asynchronous schedule {schedule.name!r}: tied modules ({keys}) are not supported: their "
            "copies on different stages would step at different times and hold different versions"
        )


def describe(schedule: Any) -> str:
    """A schedule's name for messages (a name, or a Schedule's own)."""
    return schedule if isinstance(schedule, str) else getattr(schedule, "name", repr(schedule))
