"""The engine around a rank's built stages: hybrid axes, optimizers, transport, hooks, interpreter, runner.

One function, :func:`assemble`, whatever frontend built the parts, in the order the parts need each other:
the parts are registered on the Pipeline under their one-process names; replicas a user built are made
equal; the hybrid axes split, shard or replicate the stages before any optimizer sees their parameters;
the transport exists before anything communicates; the hooks know every part with work at SYNC and STEP
(and, with ``offload=``, step the optimizers on the host);
an asynchronous schedule gets the version-aware interpreter. The Pipeline keeps what this returns.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..ir import Schedule
from ..passes import forward_only
from ..validate import async_table
from .asynchronous.interpreter import AsyncInterpreter
from .asynchronous.versions import StageVersions, VersionedStage
from .asynchronous.windows import Windows
from .comm import groups
from .comm.transport.choose import resolve
from .comm.transport.protocol import Transport, TransportSpec
from .context import PipelineContext
from .elastic.config import snapshot_config
from .elastic.snapshots import Snapshotter
from .engine.hooks import StageHooks, optimizer_per_stage
from .engine.interpreter import Interpreter
from .engine.messages import Mailbox
from .engine.runner import Runner
from .engine.stage import Stage
from .errors import PipelineError
from .features.batchnorm import attach_batchnorms, check_batchnorm
from .features.finite import finite_check
from .features.memory import ActivationMeter
from .features.offload import offload_optimizers
from .features.precision import autocast_context, autocast_loss
from .frontends.parts import Parts
from .frontends.tied import TiedBuilder, TiedSync, stage_parameters
from .options import Options

if TYPE_CHECKING:
    from .hybrid.hybrid import Hybrid


@dataclass(eq=False)  # held in a WeakSet (by identity)
class Held:
    """What a pipeline holds of torch.distributed, let go at interpreter exit (see :mod:`.comm.lifecycle`)."""

    transport: Transport | None = None
    tied: TiedSync | None = None
    hybrid: Hybrid | None = None

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
    held: Held = field(default_factory=Held)


def assemble(root: nn.Module, ctx: PipelineContext, parts: Parts, options: Options, held: Held) -> Engine:
    """Register ``parts`` on ``root`` and build the engine around them; ``held`` learns each resource as it is made
    (so a constructor failing half-way still lets go of its process groups at exit).

    Once the transport exists, a failure on this rank (a tensor-parallel plan this rank cannot apply, a stage
    that does not build) is posted on the pipeline's board, so that the other ranks stop at their next wait
    naming this one instead of waiting out the deadline.
    """
    parts.register(root)
    held.hybrid = ctx.hybrid
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
    if ctx.hybrid is not None:  # split, shard or replicate the stages before optimizers see them
        if not parts.seeded:
            _replicate_first(ctx.hybrid, parts.modules, wait)
        whole = tied.parameter_ids()
        ctx.hybrid.attach(root, parts.modules, options.tp_plan, wait, whole)
        ctx.hybrid.bound_groups(options.timeout)  # FSDP2's and DTensor's collectives stop at the pipeline's timeout
    optimizers = optimizer_per_stage(parts.modules, options.optimizer, stage_parameters)
    offload = offload_optimizers(options.offload, optimizers, ctx.device, transport.guard.wait_gpu)
    transport.warm_up()
    schedule, m = ctx.schedule, ctx.schedule.num_microbatches
    mailbox = Mailbox(transport, schedule.placement, m, ctx.device, variable_shapes=options.variable_shapes)
    mesh = None if ctx.hybrid is None else ctx.hybrid.mesh
    tied_sync = TiedSync(
        tied, parts.layer_ranges, schedule.placement, ctx.rank, ctx.group, wait, mesh, transport.guard.call
    )  # (its process groups are made within the deadline: guard.call)
    held.tied = tied_sync
    for tied_group in tied_sync.groups.values():
        groups.bound(tied_group, options.timeout)
    hooks = StageHooks([tied_sync] if ctx.hybrid is None else [ctx.hybrid, tied_sync], optimizers, offload)
    precision = autocast_context(options.autocast, ctx.device)
    stages = {s: Stage(s, mods, options.recompute, precision, 1.0 / m) for s, mods in parts.modules.items()}
    interpreter = _interpreter(ctx, options, stages, optimizers, transport, mailbox, hooks)
    meter = ActivationMeter(root.parameters(), lambda: interpreter.current) if options.measure_memory else None
    norms = attach_batchnorms(
        check_batchnorm(options.batchnorm), parts.modules, lambda: interpreter.current,
        hybrid=ctx.hybrid, group=ctx.group, num_microbatches=m, wait=wait,
    )  # fmt: skip
    hooks.parts.append(norms)
    eval_schedule = forward_only(schedule)  # validated: what eval_step runs
    runner = Runner(
        rank=ctx.rank,
        schedule=schedule,
        device=ctx.device,
        transport=transport,
        interpreter=interpreter,
        stages=stages,
        train_actions=schedule.ranks[ctx.rank],
        eval_actions=eval_schedule.ranks[ctx.rank],
        batch_dims=(options.batch_dim, options.target_batch_dim),
        has_loss=options.loss_fn is not None,
        tied=tied_sync,
        hybrid=ctx.hybrid,
        meter=meter,
        norms=norms,
        loss_weights=options.loss_weights,
        windows=Windows(schedule, ctx.rank) if async_table(schedule) is not None else None,
    )
    named = list(nn.Module.named_parameters(root)) + [
        (f"{name}.{k}", p) for name, module in parts.tied_copies.items() for k, p in module.named_parameters()
    ]
    runner.finite = finite_check(options.nan_policy, runner, transport, ctx.hybrid, named)
    if runner.finite is not None:
        hooks.parts.append(runner)  # its before_step runs the check at the first STEP (at every STEP: async)
    runner.snapshots = snapshotter(root, ctx, options)
    if runner.snapshots is not None:
        hooks.parts.append(runner.snapshots)  # its before_step: a STEP waits until the last snapshot is copied
    return Engine(transport, optimizers, mailbox, tied_sync, hooks, runner, eval_schedule, held)


def snapshotter(root: nn.Module, ctx: PipelineContext, options: Options) -> Snapshotter | None:
    """``snapshot=``: this rank's snapshots in its machine's and a peer's memory (:mod:`.elastic`), or None."""
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
) -> Interpreter:
    """The interpreter of this rank's actions: version-aware when the schedule is asynchronous."""
    base = Interpreter(
        rank=ctx.rank,
        placement=ctx.schedule.placement,
        stages=dict(stages),
        loss_fn=autocast_loss(options.loss_fn, autocast_context(options.autocast, ctx.device)),
        transport=transport,
        mailbox=mailbox,
        hooks=hooks,
    )
    base.slowdown = options.slowdown_of(ctx.rank, ctx.num_ranks)
    if async_table(ctx.schedule) is None:
        return base
    versioned = {s: VersionedStage(st) for s, st in stages.items()}
    versions = {s: StageVersions(versioned[s], optimizers.get(s)) for s in versioned}
    return AsyncInterpreter(base, versioned, versions)


def make_transport(ctx: PipelineContext, options: Options) -> Transport:
    """The pipeline's transport: ``options.transport`` as :func:`.comm.transport.choose.resolve` reads it."""
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


@torch.no_grad()
def _replicate_first(hybrid: Hybrid, modules: dict[int, list[nn.Module]], wait: Any) -> None:
    """Make every replica of this rank's stages (over the dp, sharding and tp axes) hold the first one's values.

    A model built by the user on every rank need not be built alike (no seed, or a seed per rank); data
    parallelism averages gradients and would train different replicas forever after, and tensor
    parallelism splits each rank's own copy. So, as torch's DistributedDataParallel does at construction,
    the first replica's parameters and buffers are handed to the others: a sum where every other replica
    adds zeros, exact in any order.
    """
    config = hybrid.config
    axes = tuple(a for a in ("dp", "sharding", "tp") if config.size(a) > 1)
    if not axes:
        return
    first = all(getattr(hybrid.mesh.coords, a) == 0 for a in axes)
    tensors: dict[int, torch.Tensor] = {}
    for mods in modules.values():
        for module in mods:
            for t in [*module.parameters(), *module.buffers()]:
                if not t.is_meta:
                    tensors.setdefault(id(t), t)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors.values():
        by_dtype.setdefault(t.dtype, []).append(t)
    for dtype, same in by_dtype.items():  # one reduction per dtype, not per tensor
        wire = torch.uint8 if dtype is torch.bool else dtype  # (gloo sums no bools)
        if first:
            flat = torch.cat([t.detach().reshape(-1) for t in same]).to(wire)
        else:
            flat = torch.zeros(sum(t.numel() for t in same), dtype=wire, device=same[0].device)
        hybrid.mesh.all_reduce(flat, axes, wait=wait, what=f"the first replica's {dtype} weights")
        flat = flat.to(dtype)
        at = 0
        for t in same:
            t.copy_(flat[at : at + t.numel()].view_as(t))
            at += t.numel()
