"""The engine around a rank's built stages: hybrid axes, optimizers, transport, hooks, interpreter, runner.

One function, :func:`assemble`, whatever frontend built the parts, in the order the parts need each other:
the parts are registered on the Pipeline under their one-process names; replicas a user built are made
equal; the hybrid axes split, shard or replicate the stages before any optimizer sees their parameters;
the transport exists before anything communicates; each stage's forward is composed from the options that
change it (autocast, recompute, aux losses); the interpreter's table of handlers is filled (an asynchronous
schedule's version-aware handlers in place of F, B, SYNC and STEP), with each stage's facts (its backward
path) decided here.

It registers, in order, every part with work at a stage's SYNC and STEP (:class:`~..engine.hooks.StagePart`:
the hybrid axes, the tied sums, BatchNorm, the check of non-finite values; with ``offload=``, the optimizers
step on the host) and around each step (:class:`~..engine.runner.StepPart`: the gradient merge, the tied sums,
the hybrid axes, the activation meter, BatchNorm, the check, the aux totals, dropout's seeds, what it
reports): the engine knows none of them by name, and each reads the run it takes part in from the run value.
The Pipeline keeps what this returns.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ...ir import Kind, Schedule
from ...passes import forward_only
from ...schedules import is_asynchronous
from ..asynchronous.handlers import AsyncHandlers
from ..asynchronous.versions import StageVersions, VersionedStage
from ..asynchronous.windows import Windows
from ..comm import groups
from ..comm.choose_transport import resolve
from ..comm.transport.protocol import Transport, TransportSpec
from ..elastic.config import snapshot_config
from ..elastic.snapshots import Snapshotter
from ..engine.batches import Batches
from ..engine.compute import Compute, Handler, StageFacts
from ..engine.hooks import StageHooks, optimizer_per_stage
from ..engine.interpreter import Interpreter
from ..engine.messages import Mailbox
from ..engine.runner import OneList, Runner, StepPart, TrainLists
from ..engine.stage import Forward, Stage
from ..errors import PipelineError
from ..features.aux_loss import AuxTotals
from ..features.batchnorm import attach_batchnorms, check_batchnorm
from ..features.dropout import DropoutSeeds, dropout_seeds
from ..features.evaluation import InputStructure
from ..features.finite import FinitePart, finite_check
from ..features.memory import ActivationMeter
from ..features.merge import GradientMerge
from ..features.offload import Offload, offload_optimizers
from ..features.owned_step import Scheduled, clip_part, guard_owned, schedulers_per_stage
from ..features.precision import autocast_context, autocast_loss
from ..features.recompute import run_layers
from ..frontends.parts import Parts, PipelineContext
from ..frontends.tied import TiedBuilder, TiedSync, stage_parameters
from ..hybrid.replicate import replicate_first
from ..options import Options
from ..reporting.reporter import Reporter
from .step_parts import HybridPart, MeterPart, TiedPart, reporting_part

if TYPE_CHECKING:
    from ..hybrid.hybrid import Hybrid


@dataclass(eq=False)  # held in a WeakSet (by identity)
class Held:
    """What a pipeline holds of torch.distributed, let go at interpreter exit (see :mod:`..comm.lifecycle`)."""

    transport: Transport | None = None
    tied: TiedSync | None = None
    hybrid: Hybrid | None = None
    made: list[Any] = field(default_factory=list)  # the process groups its build made (pipe.close() destroys them)

    def release_at_exit(self) -> None:
        transport = self.transport
        if transport is None:
            return
        transport.close()  # (which lets go of its process groups unless a failure stands)
        if transport.guard.failure is None and self.tied is not None:
            self.tied.groups = {}
        if transport.guard.failure is None and self.hybrid is not None:
            self.hybrid.drop_groups()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


@dataclass
class Engine:
    """What runs a pipeline's steps on this rank."""

    transport: Transport
    optimizers: dict[int, torch.optim.Optimizer]
    mailbox: Mailbox
    tied: TiedSync
    hooks: StageHooks
    runner: Runner
    eval_schedule: Schedule
    finite: FinitePart | None  # the check of non-finite values (None: nan_policy=None)
    aux: AuxTotals
    meter: ActivationMeter | None  # measure_memory=True
    reporter: Reporter  # metrics=, progress=, the events; each mode's last run
    held: Held = field(default_factory=Held)
    merge: GradientMerge = field(default_factory=GradientMerge)
    dropout: DropoutSeeds | None = None
    snapshots: Snapshotter | None = None  # snapshot=: resumed by sw.checkpoint.resume
    versions: dict[int, StageVersions] | None = None  # an asynchronous schedule's weight versions, per local stage
    schedulers: dict[int, Any] = field(default_factory=dict)  # lr_scheduler=: one per stage's optimizer
    offload: Offload | None = None  # offload="optimizer": the optimizers' state and update on the host

    def add_part(self, part: StepPart, wrap: Callable[[Kind, Handler], Handler] | None = None) -> None:
        """Add ``part`` to every run (after the parts the assembly registered); with ``wrap``, each handler of the
        interpreter's table is replaced by ``wrap(kind, handler)``: a feature that sees each action as it runs,
        through the run value, without the interpreter knowing it."""
        self.runner.parts.append(part)
        if wrap is not None:
            interpreter = self.runner.interpreter
            for kind, handler in list(interpreter.handlers.items()):
                interpreter.register(kind, wrap(kind, handler))


def assemble(root: nn.Module, ctx: PipelineContext, parts: Parts, options: Options, held: Held) -> Engine:
    """Register ``parts`` on ``root`` and build the engine around them; ``held`` learns each resource as it is made
    (so a constructor failing half-way still lets go of its process groups at exit).

    Once the transport exists, a failure on this rank (a tensor-parallel plan this rank cannot apply, a stage
    that does not build) is posted on the pipeline's board, so that the other ranks stop at their next wait
    naming this one instead of waiting out the deadline.
    """
    parts.register(root)
    held.hybrid = ctx.hybrid
    if ctx.hybrid is not None:  # an option every rank shares: refused by each alike, before the transport's gather
        ctx.hybrid.require_plan(options.tp_plan)
    transport = make_transport(ctx, options)
    held.transport = transport
    guard = transport.guard
    try:
        return _engine(root, ctx, parts, options, held, transport)
    except BaseException as err:
        if guard.failure is None and not isinstance(err, PipelineError):
            guard.fail(f"{guard.me}: building the pipeline: {type(err).__name__}: {err}")
        raise


def _engine(
    root: nn.Module, ctx: PipelineContext, parts: Parts, options: Options, held: Held, transport: Transport
) -> Engine:
    wait = transport.guard.wait  # the hybrid axes and tied sums wait within the pipeline's deadline, on its board
    tied = parts.tied or TiedBuilder([], 0)
    _attach_hybrid(root, ctx, parts, options, tied, wait)  # before optimizers see the parameters
    optimizers = optimizer_per_stage(parts.modules, options.optimizer, stage_parameters)
    offload = offload_optimizers(options.offload, optimizers, ctx.device, transport.guard.wait_gpu)
    schedulers = schedulers_per_stage(optimizers, options.lr_scheduler)  # lr_scheduler=: stepped after each
    guard_owned(optimizers)  # a user's optimizer stepping these parameters is refused on its first step
    transport.warm_up()
    schedule, m = ctx.schedule, ctx.schedule.num_microbatches
    mailbox = Mailbox(transport, schedule.placement, m, ctx.device, variable_shapes=options.variable_shapes)
    tied_sync = held.tied = _tied_sync(ctx, parts, options, tied, transport)
    stepper = Scheduled(offload, schedulers) if schedulers else offload
    hooks = StageHooks([tied_sync] if ctx.hybrid is None else [ctx.hybrid, tied_sync], optimizers, stepper)
    merge = GradientMerge()  # a step part: it sets the run's flag that SYNC, STEP and the parts read
    aux = AuxTotals(1.0 / m)
    dropout = _seed_dropout(root, parts, options, ctx)
    stages = {
        s: Stage(s, mods, _forward(s, options, ctx.device, aux, dropout), options.recompute)
        for s, mods in parts.modules.items()
    }
    meter = ActivationMeter(root.parameters()) if options.measure_memory else None  # charged what each I leaves
    interpreter, lists, asynchronous = _interpreter(ctx, options, stages, optimizers, transport, mailbox, hooks, meter)
    norms = attach_batchnorms(
        check_batchnorm(options.batchnorm), parts.modules,
        hybrid=ctx.hybrid, group=ctx.group, num_microbatches=m, wait=wait,
    )  # fmt: skip
    finite = _finite(root, ctx, parts, options, stages, transport, tied_sync, merge)  # at the first STEP
    snapshots = snapshotter(root, ctx, options)  # its before_step: a STEP waits until the last snapshot is copied
    clip = clip_part(root, options.clip, tied_sync, ctx.hybrid)  # clip=: at the first STEP, after the check
    hooks.parts += [part for part in (norms, finite, snapshots, clip) if part is not None]
    eval_schedule = forward_only(schedule)  # validated: what eval_step runs
    hybrid = None if ctx.hybrid is None else HybridPart(
        ctx.hybrid, options.target_batch_dim, ctx.device,
        weighted=options.loss_weights is not None, wait=wait,
    )  # fmt: skip
    metered = None if meter is None else MeterPart(meter)
    step_parts: list[StepPart | None] = [InputStructure()]  # first: an eval refused before anything runs
    step_parts += [asynchronous, merge, TiedPart(tied_sync), hybrid, metered, norms, finite]
    reporter = reporting_part(root, ctx, options, optimizers, finite, meter)
    step_parts += [aux, dropout, snapshots, clip, reporter]  # reporter: last
    runner = _runner(ctx, options, transport, interpreter, lists, eval_schedule, step_parts, hybrid)
    return Engine(
        transport=transport, optimizers=optimizers, mailbox=mailbox, tied=tied_sync, hooks=hooks, runner=runner,
        eval_schedule=eval_schedule, finite=finite, aux=aux, meter=meter, held=held, merge=merge, dropout=dropout,
        snapshots=snapshots, reporter=reporter, versions=None if asynchronous is None else asynchronous.versions,
        schedulers=schedulers, offload=offload,
    )  # fmt: skip


def _attach_hybrid(
    root: nn.Module, ctx: PipelineContext, parts: Parts, options: Options, tied: TiedBuilder, wait: Any
) -> None:
    """Split, shard or replicate the stages over the hybrid axes (``parallel=``), before any optimizer sees them."""
    if ctx.hybrid is None:
        return
    if not parts.seeded:
        replicate_first(ctx.hybrid, parts.modules, wait)
    ctx.hybrid.attach(root, parts.modules, options.tp_plan, wait, tied.parameter_ids())
    ctx.hybrid.bound_groups(options.timeout)  # FSDP2's and DTensor's collectives stop at the pipeline's timeout


def _tied_sync(
    ctx: PipelineContext, parts: Parts, options: Options, tied: TiedBuilder, transport: Transport
) -> TiedSync:
    """The tied modules' sums, their process groups made (and bounded) within the pipeline's deadline."""
    mesh = None if ctx.hybrid is None else ctx.hybrid.mesh
    wait, placement = transport.guard.wait, ctx.schedule.placement
    tied_sync = TiedSync(tied, parts.layer_ranges, placement, ctx.rank, ctx.group, wait, mesh, transport.guard.call)
    for tied_group in tied_sync.groups.values():
        groups.bound(tied_group, options.timeout)
    return tied_sync


def _runner(
    ctx: PipelineContext,
    options: Options,
    transport: Transport,
    interpreter: Interpreter,
    lists: TrainLists,
    eval_schedule: Schedule,
    step_parts: list[StepPart | None],
    hybrid: HybridPart | None,
) -> Runner:
    """The runner of this rank's steps, with ``step_parts`` (those not None) around and after each."""
    schedule = ctx.schedule
    over_replicas = hybrid is not None and options.loss_weights is not None and hybrid.hybrid.config.replicas > 1
    batches = Batches(
        rank=ctx.rank,
        placement=schedule.placement,
        batch_dims=(options.batch_dim, options.target_batch_dim),
        device=ctx.device,
        has_loss=options.loss_fn is not None,
        loss_weights=options.loss_weights,
        denominators=hybrid.over_replicas if over_replicas and hybrid is not None else None,
        replicas=1 if hybrid is None else hybrid.hybrid.config.replicas,
    )
    return Runner(
        rank=ctx.rank,
        schedule=schedule,
        transport=transport,
        interpreter=interpreter,
        lists=lists,
        eval_actions=eval_schedule.ranks[ctx.rank],
        batches=batches,
        parts=[part for part in step_parts if part is not None],
    )


def _seed_dropout(root: nn.Module, parts: Parts, options: Options, ctx: PipelineContext) -> DropoutSeeds:
    """Each dropout mask drawn from a generator seeded by (seed, step, micro-batch, module): alike under every
    layout and schedule (:mod:`..features.dropout`); the micro-batch is the run value's current action's."""
    named = [*nn.Module.named_modules(root)]
    named += [(f"{n}.{k}" if k else n, m) for n, module in parts.tied_copies.items() for k, m in module.named_modules()]
    seed = options.seed if options.dropout_seed is None else options.dropout_seed
    replica = 0 if ctx.hybrid is None else ctx.hybrid.mesh.replica
    return dropout_seeds(iter(named), parts.modules, seed, replica, ctx.device)


def _forward(stage: int, options: Options, device: torch.device, aux: AuxTotals, dropout: DropoutSeeds) -> Forward:
    """How stage ``stage`` runs its layers: in checkpointed segments (``recompute=``), each inside its dropout
    seeding when training, inside the collector of its aux terms, under autocast (``autocast=``)."""
    recompute = options.recompute
    precision = autocast_context(options.autocast, device)

    def layers(modules: Sequence[nn.Module], x: Any) -> Any:
        if not torch.is_grad_enabled():
            return run_layers(modules, x, None)
        return run_layers(modules, x, recompute, dropout.segments(stage))

    collected = aux.forward(stage, layers)

    def forward(modules: Any, x: Any) -> Any:
        with precision():
            return collected(modules, x)

    return forward


def _finite(
    root: nn.Module,
    ctx: PipelineContext,
    parts: Parts,
    options: Options,
    stages: dict[int, Stage],
    transport: Transport,
    tied: TiedSync,
    merge: GradientMerge,
) -> FinitePart | None:
    """The check of non-finite values (``nan_policy=``) as a part of STEP and of every train step, or None."""
    named = list(nn.Module.named_parameters(root)) + [
        (f"{name}.{k}", p) for name, module in parts.tied_copies.items() for k, p in module.named_parameters()
    ]
    check = finite_check(options.nan_policy, stages, ctx.rank, ctx.device, transport, ctx.hybrid, named, merge)
    if check is None:
        return None
    hybrid = ctx.hybrid

    def settle() -> None:  # every gradient final: the tied sums and the hybrid axes' reductions waited for
        tied.finish()
        if hybrid is not None:
            hybrid.wait_reductions()

    def settle_stage(stage: int) -> None:
        if hybrid is not None:
            hybrid.wait_reductions(stage)

    asynchronous = is_asynchronous(ctx.schedule)
    return FinitePart(
        check, placement=ctx.schedule.placement, asynchronous=asynchronous, settle=settle, settle_stage=settle_stage
    )


def snapshotter(root: nn.Module, ctx: PipelineContext, options: Options) -> Snapshotter | None:
    """``snapshot=``: this rank's snapshots in its machine's and a peer's memory (:mod:`..elastic`), or None."""
    config = snapshot_config(options.snapshot)
    if config is None:
        return None
    return Snapshotter(config, root, ctx.cut_group, options.timeout)


def _interpreter(
    ctx: PipelineContext,
    options: Options,
    stages: dict[int, Stage],
    optimizers: dict[int, torch.optim.Optimizer],
    transport: Transport,
    mailbox: Mailbox,
    hooks: StageHooks,
    meter: ActivationMeter | None,
) -> tuple[Interpreter, TrainLists, AsyncHandlers | None]:
    """The interpreter of this rank's actions, its table filled, and what a train step runs: the schedule's
    list, or, when the schedule is asynchronous, its windows (the version-aware handlers in the table, and
    returned: they are a part of every run too)."""
    loss_fn = autocast_loss(options.loss_fn, autocast_context(options.autocast, ctx.device))
    last = len(ctx.schedule.placement) - 1
    interpreter = Interpreter(
        rank=ctx.rank,
        placement=ctx.schedule.placement,
        transport=transport,
        mailbox=mailbox,
        slowdown=options.slowdown_of(ctx.rank, ctx.num_ranks),
    )
    if not is_asynchronous(ctx.schedule):
        facts = {s: StageFacts.of(st.modules, st.recompute is not None) for s, st in stages.items()}
        compute = Compute(stages, loss_fn, last, facts, meter)
        for kind, handler in {**compute.handlers(), **hooks.handlers()}.items():
            interpreter.register(kind, handler)
        return interpreter, OneList(ctx.schedule.ranks[ctx.rank], ctx.schedule.num_microbatches), None
    versioned = {s: VersionedStage(st) for s, st in stages.items()}
    versions = {s: StageVersions(versioned[s], optimizers.get(s)) for s in versioned}
    compute = Compute(versioned, loss_fn, last, meter=meter)
    handlers = AsyncHandlers(compute, hooks, versioned, versions)
    for kind, handler in {**compute.handlers(), **hooks.handlers(), **handlers.handlers()}.items():
        interpreter.register(kind, handler)
    return interpreter, Windows(ctx.schedule, ctx.rank), handlers


def make_transport(ctx: PipelineContext, options: Options) -> Transport:
    """The pipeline's transport: ``options.transport`` as :func:`..comm.choose_transport.resolve` reads it."""
    name, pipeline_id = groups.next_pipeline_id(ctx.group)
    hybrid = ctx.hybrid
    spec = TransportSpec(
        ctx.group,
        name=name,
        pipeline_id=pipeline_id,
        timeout=options.timeout,
        store=options.store,
        board=None if hybrid is None else hybrid.board_name(),  # a failure anywhere stops the whole mesh
        label=None if hybrid is None else f"pipeline rank {ctx.rank} ({hybrid.mesh.where()})",
    )
    return resolve(options.transport)(spec)
