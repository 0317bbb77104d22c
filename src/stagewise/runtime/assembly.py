"""The engine around a rank's built stages: hybrid axes, optimizers, transport, hooks, interpreter, runner.

One function, :func:`build_engine`, in the order the parts need each other
(the hybrid axes split or shard the stages before any optimizer sees their
parameters; the transport exists before anything communicates; the hooks know
every part with work at SYNC and STEP). The Pipeline only registers the stages
under their names and keeps what this returns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..ir import Schedule
from .asynchronous.train import check_async
from .comm import groups
from .comm.transport.choose import resolve
from .comm.transport.protocol import Transport, TransportSpec
from .context import PipelineContext
from .engine.hooks import StageHooks, optimizer_per_stage
from .engine.interpreter import Interpreter
from .engine.messages import Mailbox
from .engine.runner import Runner
from .engine.stage import Stage
from .features.batchnorm import attach_batchnorms, check_batchnorm
from .features.memory import ActivationMeter
from .features.precision import autocast_context, autocast_loss
from .frontends.stages import BuiltStages
from .frontends.tied import TiedBuilder, TiedSync, stage_parameters
from .options import RunOptions

if TYPE_CHECKING:
    from collections.abc import Callable

    from .hybrid.tensor_parallel import TPPlan


@dataclass
class Engine:
    """What runs a pipeline's steps on this rank."""

    transport: Transport
    optimizers: dict[int, torch.optim.Optimizer]
    mailbox: Mailbox
    tied: TiedSync
    hooks: StageHooks
    runner: Runner


def build_engine(
    root: nn.Module,
    ctx: PipelineContext,
    parts: BuiltStages,
    options: RunOptions,
    tp_plan: TPPlan | None,
    eval_schedule: Schedule,
    *,
    on_transport: Callable[[Transport], None],
) -> Engine:
    """The engine for ``parts`` (already registered on ``root``); ``on_transport`` is told the transport first."""
    _refuse(ctx, parts, options)
    made: list[Transport] = []

    def wait(works: list[Any], what: str) -> None:  # the hybrid axes and tied sums wait through the transport
        made[0].wait(works, what)

    tied = parts.tied or TiedBuilder([], 0)
    if ctx.hybrid is not None:  # split, shard or replicate the stages before optimizers see them
        whole = {id(p) for m in tied.built.values() for p in m.parameters()}
        ctx.hybrid.attach(root, parts.modules, tp_plan, wait, whole)
        ctx.hybrid.bound_groups(options.timeout)  # FSDP2's and DTensor's collectives stop at the pipeline's timeout
    optimizers = optimizer_per_stage(parts.modules, options.optimizer, stage_parameters)
    transport = make_transport(ctx, options)
    made.append(transport)
    on_transport(transport)
    transport.warm_up()
    schedule, m = ctx.schedule, ctx.schedule.num_microbatches
    mailbox = Mailbox(transport, schedule.placement, m, ctx.device, variable_shapes=options.variable_shapes)
    mesh = None if ctx.hybrid is None else ctx.hybrid.mesh
    tied_sync = TiedSync(
        tied, parts.layer_ranges, schedule.placement, ctx.rank, ctx.group, wait, mesh, transport.call
    )  # (its process groups are made within the deadline: transport.call)
    for tied_group in tied_sync.groups.values():
        groups.bound(tied_group, options.timeout)
    hooks = StageHooks([tied_sync] if ctx.hybrid is None else [ctx.hybrid, tied_sync], optimizers)
    precision = autocast_context(options.autocast, ctx.device)
    stages = {s: Stage(s, mods, options.recompute, precision, 1.0 / m) for s, mods in parts.modules.items()}
    interpreter = Interpreter(
        rank=ctx.rank,
        placement=schedule.placement,
        stages=dict(stages),
        loss_fn=autocast_loss(options.loss_fn, precision),
        transport=transport,
        mailbox=mailbox,
        hooks=hooks,
    )
    interpreter.slowdown = options.slowdown_of(ctx.rank, ctx.num_ranks)
    meter = ActivationMeter(root.parameters(), lambda: interpreter.current) if options.measure_memory else None
    norms = attach_batchnorms(
        check_batchnorm(options.batchnorm), parts.modules, lambda: interpreter.current,
        hybrid=ctx.hybrid, group=ctx.group, num_microbatches=m, wait=wait,
    )  # fmt: skip
    hooks.parts.append(norms)
    runner = Runner(
        ctx.rank, schedule, ctx.device, transport, interpreter, stages, schedule.ranks[ctx.rank],
        eval_schedule.ranks[ctx.rank], (options.batch_dim, options.target_batch_dim), options.loss_fn is not None,
        tied_sync, ctx.hybrid, meter, norms, options.loss_weights,
    )  # fmt: skip
    return Engine(transport, optimizers, mailbox, tied_sync, hooks, runner)


def make_transport(ctx: PipelineContext, options: RunOptions) -> Transport:
    """The pipeline's transport: ``options.transport`` as :func:`.comm.choose.resolve` reads it ("auto" unset)."""
    name, pipeline_id = groups.next_pipeline_id(ctx.group)
    hybrid = ctx.hybrid
    spec = TransportSpec(
        ctx.group,
        name=name,
        pipeline_id=pipeline_id,
        timeout=options.timeout,
        store=options.store,
        board=None if hybrid is None else hybrid.board_name(),  # a failure anywhere stops the whole mesh
        label=None if hybrid is None else f"rank {ctx.rank} ({hybrid.mesh.where()})",
    )
    return resolve(options.transport)(spec)


def _refuse(ctx: PipelineContext, parts: BuiltStages, options: RunOptions) -> None:
    """What the options cannot do with this schedule and layout, before anything communicates."""
    check_async(ctx.schedule, options, parts)  # asynchronous schedules: refuse what they cannot run, now
    if options.loss_weights is not None and ctx.hybrid is not None and ctx.hybrid.config.replicas > 1:
        raise NotImplementedError(
            "loss_weights= with data-parallel replicas: replicas average their gradients with equal weights, "
            "not by their token counts; use loss_weights with pipeline parallelism only"
        )
