"""``Pipeline``: a model cut into stages over a process group, trained by interpreting a schedule.

Every rank builds the same Pipeline (SPMD). A rank builds only the layers of
its own stages; the Pipeline *is* an ``nn.Module`` holding them under their
names in the original model, so ``parameters()``, ``named_parameters()`` and
``state_dict()`` give this rank's share with the keys a one-process model has.

Construction is three steps, each its own module: resolve where the pipeline
runs (:mod:`.context`), build this rank's stages (a frontend:
:mod:`.model.stages` for layer lists, :mod:`.frontends.from_model`, or the
caller's own with :meth:`Pipeline.from_stages`), then assemble the engine
around them (:meth:`Pipeline._assemble`: hybrid axes, optimizers, transport,
hooks, interpreter).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..actions import Action, Kind
from ..schedule import Schedule
from ..stage_counts import PartitionSpec
from ..timeline import Timeline
from .comm import groups, lifecycle
from .comm.torch_p2p import TorchTransport
from .comm.transport import Transport, TransportFactory, TransportSpec
from .context import PipelineContext, resolve_context
from .engine.finite import finite_check
from .engine.hooks import StageHooks, optimizer_per_stage
from .engine.interpreter import Interpreter
from .engine.memory import ActivationMeter
from .engine.messages import Mailbox
from .engine.microbatch import Dims
from .engine.precision import autocast_context, autocast_loss
from .engine.recompute import Recompute
from .engine.reports import gathered_losses, step_timeline
from .engine.runner import Runner
from .engine.stage import Stage
from .model.layers import Layers, named_layers
from .model.stages import BuiltStages, build_layer_stages, given_stages
from .model.tied import TiedBuilder, TiedSync, stage_parameters
from .options import LossFn, OptimizerFactory, RunOptions

if TYPE_CHECKING:
    from ..parallel import ParallelConfig
    from .hybrid.mesh import Mesh
    from .hybrid.tensor_parallel import TPPlan


class Pipeline(nn.Module):
    """A model pipelined over the ranks of ``group`` by the schedule ``schedule``.

    ``layers``: an ``nn.Sequential``, a list (or dict) of modules, or of
    :class:`~stagewise.Layer` specs built lazily, each seeded with
    ``seed + layer index`` (so :func:`~stagewise.build_model` with the same
    seed is the one-process twin). ``schedule``: a registered name or a
    :class:`~stagewise.Schedule` (e.g. loaded from CSV; its rank count must be
    the group size). ``microbatches`` defaults to the schedule's count, or the
    group size for a name; ``virtual_stages`` to the schedule's default.
    ``partition``: ``"uniform"``, ``"parameters"``, ``"time"``, ``"memory"`` or
    layer counts per stage; ``"time"`` and ``"memory"`` profile the layers on
    ``sample_inputs`` (one micro-batch) on the group's first rank, building one
    layer at a time (:mod:`stagewise.runtime.model.balance`). ``speeds`` and
    ``memory_caps`` (bytes), one per rank, describe heterogeneous ranks: a rank
    at speed 0.5 gets about half the work, none holds more than its cap.
    ``loss_fn(output, target)`` must return the micro-batch's *mean* loss; each
    micro-batch's loss is weighted by its share of the batch, so a step's
    gradients are those of the mean loss over the whole batch. ``optimizer``:
    an optional factory ``params -> Optimizer``, one per stage, stepped (and
    zeroed) by the schedule's STEP actions.
    ``batch_dim`` / ``target_batch_dim``: where the batch dim of the inputs /
    targets is (see :mod:`stagewise.runtime.engine.microbatch`). ``timeout``: seconds
    any wait may take before every rank raises :class:`PipelineError`; the
    error names, on each rank, the action it was in and what it waited for
    (:mod:`stagewise.runtime.engine.forensics`). ``autocast``: ``torch.bfloat16`` (or
    ``float16``) runs each stage's forward and the loss under
    ``torch.autocast`` (:mod:`stagewise.runtime.engine.precision`).
    ``variable_shapes``: values between stages may change shape from one
    micro-batch or step to the next (packed / variable-length sequences; pass
    pre-cut micro-batches as :class:`~stagewise.MicroBatches`); each value then
    carries its shapes. Off, shapes are learned on the first step and a later
    change is an error naming the stage and tensor. ``transport``: a factory
    ``TransportSpec -> Transport`` (:mod:`stagewise.runtime.comm.transport`);
    the default is torch.distributed point-to-point. ``nan_policy``: a
    non-finite loss or gradient anywhere in the mesh either raises on every
    rank before any optimizer steps (``"raise"``) or skips the step on every
    rank, counted in :attr:`skipped_steps` (``"skip"``); see
    :mod:`stagewise.runtime.engine.finite`.

    ``parallel``: a :class:`~stagewise.ParallelConfig` (or a built
    :class:`~stagewise.Mesh`) for pipeline x data x ZeRO-sharded x tensor
    parallelism: the schedule runs on the mesh's ``pp`` group (so ``group``
    must be None), stages are replicated over ``dp`` and sharded over
    ``sharding`` (gradients reduced at each stage's SYNC), and the layers that
    ``tp_plan`` names are split over ``tp`` (see :mod:`stagewise.runtime.hybrid.hybrid`).
    Each data-parallel replica trains on its own slice (:meth:`local_batch`).

    Every rank of the group must build its Pipelines in the same order.
    """

    def __init__(
        self,
        layers: Layers,
        *,
        loss_fn: LossFn | None = None,
        schedule: str | Schedule = "1f1b",
        microbatches: int | None = None,
        virtual_stages: int | None = None,
        partition: PartitionSpec = "uniform",
        sample_inputs: Any = None,
        speeds: Sequence[float] | None = None,
        memory_caps: Sequence[float] | None = None,
        group: Any = None,
        parallel: ParallelConfig | Mesh | None = None,
        tp_plan: TPPlan | None = None,
        seed: int = 0,
        device: torch.device | str | None = None,
        optimizer: OptimizerFactory | None = None,
        batch_dim: Dims = 0,
        target_batch_dim: Dims = 0,
        timeout: float = 300.0,
        store: Any = None,
        recompute: Recompute = None,
        measure_memory: bool = False,
        autocast: torch.dtype | None = None,
        variable_shapes: bool = False,
        transport: TransportFactory | None = None,
        nan_policy: str = "raise",
    ) -> None:
        super().__init__()
        options = RunOptions(
            loss_fn, optimizer, batch_dim, target_batch_dim, timeout, store, recompute, measure_memory, autocast,
            variable_shapes, transport, nan_policy,
        )  # fmt: skip
        ctx = resolve_context(
            schedule=schedule,
            microbatches=microbatches,
            virtual_stages=virtual_stages,
            group=group,
            parallel=parallel,
            device=device,
        )
        named = named_layers(layers)
        parts = build_layer_stages(
            named,
            ctx,
            partition=partition,
            sample_inputs=sample_inputs,
            speeds=speeds,
            memory_caps=memory_caps,
            seed=seed,
        )
        if ctx.hybrid is not None and ctx.hybrid.config.tp > 1 and parts.tied is not None:
            parts.tied.check_plan([n for n, _ in named], tp_plan)
        self._assemble(ctx, parts, options, tp_plan)

    # ---- other constructors -------------------------------------------------
    @classmethod
    def from_model(cls, model: nn.Module, **options: Any) -> Pipeline:
        """Pipeline an unmodified ``nn.Module``, cut at its ``pipeline_stage`` tags or among its blocks.

        See :func:`stagewise.runtime.frontends.from_model.from_model` for the options
        (``stages``, ``partition``, ``sample_inputs``, ``speeds``,
        ``memory_caps``, ``free_unused``, ``concrete_args``, and every
        Pipeline option but ``seed``).
        """
        from .frontends.from_model import from_model

        return from_model(cls, model, **options)

    @classmethod
    def from_stages(
        cls,
        stages: Mapping[int, nn.Module | Sequence[nn.Module]],
        *,
        schedule: str | Schedule = "1f1b",
        microbatches: int | None = None,
        virtual_stages: int | None = None,
        group: Any = None,
        parallel: ParallelConfig | Mesh | None = None,
        device: torch.device | str | None = None,
        **options: Any,
    ) -> Pipeline:
        """Bring your own stages: ``stages[s]`` is the module (or modules, applied in order) of stage ``s``.

        Each rank passes the stages it holds (``schedule.stages_of(rank)``), already
        built, on its device, and parallelised as you like; they are registered
        as ``stage{s}``. ``options``: the Pipeline's training options
        (``loss_fn``, ``optimizer``, ``timeout``, ...; see :class:`RunOptions`).
        """
        ctx = resolve_context(
            schedule=schedule,
            microbatches=microbatches,
            virtual_stages=virtual_stages,
            group=group,
            parallel=parallel,
            device=device,
        )
        return cls._from_parts(ctx, given_stages(stages, ctx), RunOptions(**options))

    @classmethod
    def _from_parts(
        cls, ctx: PipelineContext, parts: BuiltStages, options: RunOptions, tp_plan: TPPlan | None = None
    ) -> Pipeline:
        pipe = cls.__new__(cls)
        nn.Module.__init__(pipe)
        pipe._assemble(ctx, parts, options, tp_plan)
        return pipe

    # ---- assembly -------------------------------------------------------------
    def _assemble(self, ctx: PipelineContext, parts: BuiltStages, options: RunOptions, tp_plan: TPPlan | None) -> None:
        """Wrap the built stages in the engine: hybrid axes, optimizers, transport, hooks, interpreter."""
        self.rank, self.num_ranks, self.schedule = ctx.rank, ctx.num_ranks, ctx.schedule
        self.hybrid, self.device, self.options = ctx.hybrid, ctx.device, options
        self.loss_fn, self.batch_dim, self.target_batch_dim = (
            options.loss_fn,
            options.batch_dim,
            options.target_batch_dim,
        )
        self.local_stages = ctx.local_stages
        self.layer_ranges, self.layer_profile, self.model_cut = parts.layer_ranges, parts.profile, parts.model_cut
        self._tied_copies = parts.tied_copies
        parts.register(self)
        tied = parts.tied or TiedBuilder([], 0)
        if self.hybrid is not None:  # split, shard or replicate the stages before optimizers see them
            whole = {id(p) for m in tied.built.values() for p in m.parameters()}
            self.hybrid.attach(self, parts.modules, tp_plan, self._wait, whole)
        self.optimizers = optimizer_per_stage(parts.modules, options.optimizer, stage_parameters)
        self.transport = self._make_transport(ctx, options)
        self.transport.warm_up()
        lifecycle.release_at_exit(self)
        m = self.schedule.num_microbatches
        self._mailbox = Mailbox(
            self.transport, self.schedule.placement, m, self.device, variable_shapes=options.variable_shapes
        )
        mesh = None if self.hybrid is None else self.hybrid.mesh
        placement, call = self.schedule.placement, self.transport.call
        self.tied = TiedSync(tied, self.layer_ranges, placement, self.rank, ctx.group, self._wait, mesh, call)
        self.hooks = StageHooks([self.tied] if self.hybrid is None else [self.hybrid, self.tied], self.optimizers)
        precision = autocast_context(options.autocast, self.device)
        stages = {s: Stage(s, mods, options.recompute, precision, 1.0 / m) for s, mods in parts.modules.items()}
        interpreter = Interpreter(
            rank=self.rank,
            placement=self.schedule.placement,
            stages=dict(stages),
            loss_fn=autocast_loss(options.loss_fn, precision),
            transport=self.transport,
            mailbox=self._mailbox,
            hooks=self.hooks,
        )
        meter = ActivationMeter(self.parameters(), lambda: interpreter.current) if options.measure_memory else None
        self._runner = Runner(
            self.rank, self.schedule, self.device, self.transport, interpreter, stages,
            train_actions(self.schedule, self.rank, options.optimizer is not None),
            eval_actions(self.schedule, self.rank),
            (options.batch_dim, options.target_batch_dim), options.loss_fn is not None, self.tied, self.hybrid, meter,
        )  # fmt: skip
        self._runner.finite = finite_check(self, options.nan_policy)
        self._clock_offset = time.time() - time.perf_counter()

    def _make_transport(self, ctx: PipelineContext, options: RunOptions) -> Transport:
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
        return (options.transport or TorchTransport)(spec)

    def _wait(self, works: list[Any], what: str) -> None:
        self.transport.wait(works, what)

    # ---- public API --------------------------------------------------------
    def train_step(self, inputs: Any = None, targets: Any = None) -> float:
        """One forward and backward of the mini-batch; returns its mean loss on every rank.

        Gradients accumulate into this rank's parameters' ``.grad`` as
        ``loss_fn(model(inputs), targets).backward()`` would in one process.
        ``inputs`` are needed on the rank holding stage 0, ``targets`` on the
        rank holding the last stage; other ranks may pass None.
        """
        return self._runner.guarded(lambda: self._runner.train(inputs, targets))

    def eval_step(self, inputs: Any = None, *, merge_outputs: bool = True) -> Any:
        """Forward only (no autograd graph); the last stage's rank gets the outputs, others None.

        Outputs are concatenated along dim 0, or returned per micro-batch with
        ``merge_outputs=False``.
        """
        return self._runner.guarded(lambda: self._runner.eval(inputs, merge_outputs))

    def timeline(self, gather: bool = False) -> Timeline:
        """What this rank executed in the last step (seconds from its start) as a measured Timeline.

        With ``gather=True`` (a collective: call it on every rank) the events of
        all ranks are collected, on one clock, so the step renders like a
        simulated one.
        """
        step = self._runner.last_step
        return step_timeline(
            [] if step is None else step.events,
            rank=self.rank,
            num_ranks=self.num_ranks,
            name=self.schedule.name,
            meta={"mode": step.mode if step else None, "microbatches": self.schedule.num_microbatches},
            started=self._runner.step_started,
            clock_offset=self._clock_offset,
            group=self.transport.group if gather else None,
            wait=self._wait,
        )

    @property
    def skipped_steps(self) -> int:
        """How many train steps ``nan_policy="skip"`` skipped for non-finite values (alike on every rank)."""
        finite = self._runner.finite
        return 0 if finite is None else finite.skipped

    def reset_shapes(self) -> None:
        """Forget the cached shapes so the next step may use new ones (call on every rank)."""
        self._mailbox.forget_shapes()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> float:
        """Clip the gradients of the whole model - every stage, every mesh axis - to total norm ``max_norm``.

        As ``torch.nn.utils.clip_grad_norm_`` on the one-process model; returns the
        norm before clipping. A collective: call it on every rank, after train_step.
        """
        from .hybrid.hybrid import clip_pipeline_grads

        return clip_pipeline_grads(self, max_norm, norm_type)

    def local_batch(self, inputs: Any = None, targets: Any = None) -> tuple[Any, Any]:
        """This rank's data-parallel share of a global batch (all of it without ``parallel=``)."""
        if self.hybrid is None:
            return inputs, targets
        h = self.hybrid
        return h.local_batch(inputs, self.batch_dim, "inputs"), h.local_batch(targets, self.target_batch_dim, "targets")

    def register_sync_hook(self, hook: Callable[[int], None]) -> None:
        """Call ``hook(stage)`` at each SYNC action, once the stage's gradients are final."""
        self.hooks.user.append(hook)

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters under their one-process names; a tied module held here only for a later use is
        reported under its first use's name (it is not in ``state_dict()``: that is saved where the first use is)."""
        yield from super().named_parameters(prefix, recurse, remove_duplicate)
        for name, module in self._tied_copies.items():
            yield from module.named_parameters(f"{prefix}.{name}" if prefix else name, recurse, remove_duplicate)

    def last_step_losses(self) -> dict[str, float]:
        """The last train_step's losses: ``{"loss": main, "aux": sum of aux terms, "aux/NAME": each}``.

        Aux terms are summed over micro-batches (each weighted ``1/m``) and
        over all ranks. A collective: call it on every rank.
        """
        losses = self._runner.losses
        loss, aux = losses.get("loss", float("nan")), losses.get("aux_local", {})
        return gathered_losses(loss, aux, self.transport.group, self._wait)

    def memory_report(self) -> dict[str, Any]:
        """Activation bytes of the last train_step on this rank (needs ``measure_memory=True``).

        ``peak_bytes``: most bytes saved for backward alive at once;
        ``forward_bytes``: ``{(stage, microbatch): bytes its F saved}``;
        ``weight_bytes``: ``{(stage, microbatch): bytes of those still alive when its W started}``
        (zero-bubble schedules only).
        See :mod:`stagewise.runtime.engine.memory`.
        """
        meter = self._runner.meter
        if meter is None:
            raise ValueError("build the Pipeline with measure_memory=True to measure activation memory")
        return {
            "peak_bytes": meter.peak,
            "forward_bytes": dict(meter.by_forward),
            "weight_bytes": dict(meter.by_weight),
        }

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("a Pipeline is not called directly: use train_step(inputs, targets) or eval_step(inputs)")

    def release_at_exit(self) -> None:
        """At interpreter exit: let go of the process groups (see :mod:`.comm.lifecycle`)."""
        transport = self.__dict__.get("transport")
        if transport is None:
            return
        transport.drop_groups()
        tied = self.__dict__.get("tied")  # absent if the constructor failed after the transport was made
        if transport.failure is None and tied is not None:
            tied.groups = {}
        if transport.failure is None and self.hybrid is not None:
            self.hybrid.drop_groups()

    def __del__(self) -> None:
        transport = self.__dict__.get("transport")
        if transport is not None:
            transport.close()


def train_actions(schedule: Schedule, rank: int, optimizing: bool) -> tuple[Action, ...]:
    """What ``rank`` executes in a train step: its list, with a STEP per local stage when it has an optimizer."""
    actions = schedule.ranks[rank]
    if not optimizing:
        return tuple(actions)
    stepped = {a.stage for a in actions if a.kind is Kind.STEP}
    extra = [Action(s, Kind.STEP) for s in schedule.stages_of(rank) if s not in stepped]
    return tuple(actions) + tuple(extra)


def eval_actions(schedule: Schedule, rank: int) -> tuple[Action, ...]:
    """What ``rank`` executes in an eval step: the forwards and their communication."""
    return tuple(a for a in schedule.ranks[rank] if a.kind in (Kind.F, Kind.SEND_F, Kind.RECV_F))
