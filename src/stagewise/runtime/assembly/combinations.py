"""Which options combine: every combination stagewise cannot run exactly is refused here, by name.

The checks are pure in the options, the schedule and (for ties) what the frontend built, so every rank
raises alike, before any rank communicates: the schedule is resolved, and these run, before the mesh's
process groups exist. Each message names the way in, the schedule and the options that clash, and what
to do instead. The combination matrix in the docs lists what is exact and what is refused here.

Asynchronous schedules (PipeDream, 2BW, XPipe) step each stage at its own STEPs, so:

* they need ``optimizer=`` (a factory: each stage applies its own optimizer);
* ``clip=`` is refused: the whole model's norm needs every stage's gradient of one step at once;
* ``recompute=`` is refused: a checkpointed segment would recompute on the live weights, not the stashed
  version its forward used;
* ``nan_policy="skip"`` is refused: the stages step at different times, so no mini-batch can be skipped on
  every rank before the first of them has stepped (``"raise"`` checks every stage at each of its STEPs);
* ``parallel=`` with ``tp`` or ``sharding`` is refused: weight snapshots of split or sharded parameters are
  not implemented (``dp`` is supported);
* tied modules are refused: their copies on two stages would step at different times;
* ``xpipe`` needs an optimizer with a prediction rule (SGD with momentum, Adam, AdamW);
* ``no_sync()`` (a gradient merge over train steps, :mod:`..features.merge`) is refused: a stage steps at its own
  STEPs inside a window, each mini-batch on the weight version its forward used, so there is no step whose
  gradients several mini-batches could add up to. HetPipe refuses it too: each wave's update is pushed to the
  other virtual workers as the wave ends. Both take more micro-batches per mini-batch instead.

HetPipe (:func:`refuse_hetpipe`) trains each virtual worker's pipeline by the wave rule, so it needs
``optimizer=`` and ``loss_fn=`` (each worker trains its waves), and refuses ``group=`` and ``parallel=`` (each
worker runs on its own ranks; the workers are its data parallelism), BatchNorm policies (the rule shares
parameters only), ``nan_policy="skip"`` (a worker cannot skip an update the others count) and tied modules
(each parameter needs one owner per worker, whose update it pushes).

``snapshot=`` (:mod:`..elastic`) needs ``optimizer=`` (a snapshot holds the pipeline's own optimizers, and
their step waits for its copy), a synchronous schedule, and whole tensors (``tp`` and ``sharding`` refused).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ...ir import Schedule
from ...schedules import is_asynchronous
from ...validate import async_table
from ..frontends.layers import Layers, named_layers
from ..frontends.parts import FROM_MODELS, LAYERS_ONLY
from ..frontends.tied import Tied
from ..options import check_applicable

if TYPE_CHECKING:
    from ..frontends.parts import Parts
    from ..options import Options


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
    if options.clip is not None:
        raise ValueError(
            f"{name}: clip= is not supported: the whole model's gradient norm needs every stage's gradient of one "
            "step at once, and the stages step at different times"
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
        from ..asynchronous.predict import check_predictable

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
    if is_asynchronous(schedule) and parts.tied is not None and parts.tied.uses:  # declared ties and found ones
        keys = ", ".join(sorted(parts.tied.uses))
        raise ValueError(
            f"{entry} with asynchronous schedule {schedule.name!r}: tied modules ({keys}) are not supported: their "
            "copies on different stages would step at different times and hold different versions"
        )


#: the refusal of a gradient merge by HetPipe (the words its error starts with)
HETPIPE_NO_SYNC = "HetPipe does not take no_sync()"


def refuse_no_sync(entry: str, schedule: Schedule | None) -> None:
    """``no_sync()`` (a gradient merge) on a pipeline running ``schedule`` (None: a HetPipe), refused alike on every
    rank, before any step runs."""
    if schedule is None:
        raise ValueError(
            f"{HETPIPE_NO_SYNC} (a gradient merge): each wave's update is pushed to the other virtual workers as the "
            "wave ends (wave-synchronous parallel), so no wave's gradients can wait for the next; give each wave "
            "more micro-batches (microbatches=) instead"
        )
    if is_asynchronous(schedule):
        raise ValueError(
            f"{entry} with asynchronous schedule {schedule.name!r}: no_sync() (a gradient merge) is not supported: "
            "each stage steps at its own STEPs inside a window, every mini-batch on the weight version its forward "
            "used, so no step could add up the gradients of several; give each mini-batch more micro-batches "
            "(microbatches=) instead"
        )


_OWN_RANKS = "each virtual worker's pipeline runs on its own ranks (virtual_workers= says which)"
#: options HetPipe cannot take, and why
HETPIPE_REFUSED = {
    "group": _OWN_RANKS,
    "parallel": _OWN_RANKS + "; the virtual workers are HetPipe's data parallelism",
    "batchnorm": "the wave rule shares parameters only: BatchNorm running statistics stay each virtual worker's own",
    "free_unused": FROM_MODELS,
    "concrete_args": LAYERS_ONLY,
    "snapshot": "a virtual worker's state is its own pipeline's plus the wave rule's; use sw.checkpoint.save",
}


def refuse_hetpipe(layers: Layers, options: Options) -> None:
    """What the wave rule cannot do, refused on every rank alike before any group is made."""
    check_applicable("HetPipe", HETPIPE_REFUSED, options)
    if options.nan_policy == "skip":
        raise ValueError(
            "HetPipe does not take nan_policy='skip': a virtual worker cannot skip a wave's update that the others "
            "count; use 'raise' or None"
        )
    tied = sorted({layer.key for _, layer in named_layers(layers) if isinstance(layer, Tied)})
    if tied:
        raise ValueError(
            f"HetPipe does not take tied modules (sw.Tied keys {tied}): each parameter needs one owner per virtual "
            "worker, whose update it pushes; untie them"
        )
    if options.optimizer is None:
        raise ValueError("HetPipe needs optimizer=, a factory params -> Optimizer (each VW trains its waves)")
    if options.loss_fn is None:
        raise ValueError("HetPipe needs loss_fn=, the micro-batch's mean loss (each VW trains its waves)")


def describe(schedule: Any) -> str:
    """A schedule's name for messages (a name, or a Schedule's own)."""
    return schedule if isinstance(schedule, str) else getattr(schedule, "name", repr(schedule))


def refuse_unwatchable(entry: str, pipe: Any) -> None:
    """A run calibrated or re-planned from its own steps (``RunCalibrator``, ``Replanner``) reads one pipeline's
    cut and re-lays it out; what has none (a HetPipe: virtual workers synchronised wave by wave, which no re-layout
    moves) is refused on every rank alike, before any step is watched."""
    if not hasattr(pipe, "layer_ranges") or not hasattr(pipe, "schedule"):
        raise ValueError(
            f"{entry} watches one Pipeline's cut and re-lays it out; a {type(pipe).__name__} has none (a HetPipe's "
            "virtual workers and wave rule are laid out together and re-laid out by none): watch a Pipeline, or "
            "save a checkpoint and build a new HetPipe"
        )
