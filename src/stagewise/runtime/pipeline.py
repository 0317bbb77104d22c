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
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..ir import Schedule, Timeline
from ..partition import PartitionSpec
from ..passes import forward_only
from ..validate import async_table
from .assembly import build_engine
from .asynchronous.train import train_stream
from .comm import lifecycle
from .comm.transport.choose import TransportChoice
from .comm.transport.protocol import Transport
from .context import PipelineContext, resolve_context
from .engine.microbatch import Dims
from .engine.reports import gathered_losses, step_timeline
from .features.batchnorm import BatchNormPolicy
from .features.clip import clip_pipeline_grads
from .features.finite import finite_check
from .features.recompute import Recompute
from .frontends.layers import Layers, named_layers
from .frontends.stages import BuiltStages, build_layer_stages, given_stages
from .options import LossFn, LossWeights, OptimizerFactory, RunOptions

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
    layer at a time (:mod:`stagewise.runtime.frontends.balance`). ``speeds`` and
    ``memory_caps`` (bytes), one per rank, describe heterogeneous ranks: a rank
    at speed 0.5 gets about half the work, none holds more than its cap.
    ``loss_fn(output, target)`` must return the micro-batch's *mean* loss; each
    micro-batch's loss is weighted by its share of the batch, so a step's
    gradients are those of the mean loss over the whole batch. The share is of
    the rows, or with ``loss_weights`` (a function of one micro-batch's targets
    returning a count, e.g. :func:`~stagewise.count_tokens`) of the counts:
    a token-level mean over the whole batch however unevenly the counted tokens
    fall over the micro-batches (:mod:`stagewise.runtime.losses`). ``optimizer``:
    an optional factory ``params -> Optimizer``, one per stage, stepped (and
    zeroed) by the schedule's STEP actions.
    ``batch_dim`` / ``target_batch_dim``: where the batch dim of the inputs /
    targets is (see :mod:`stagewise.runtime.engine.microbatch`). ``timeout``: seconds
    any wait may take before every rank raises :class:`PipelineError`; the
    error names, on each rank, the action it was in and what it waited for
    (:mod:`stagewise.runtime.engine.forensics`). ``autocast``: ``torch.bfloat16`` (or
    ``float16``) runs each stage's forward and the loss under
    ``torch.autocast`` (:mod:`stagewise.runtime.features.precision`).
    ``variable_shapes``: values between stages may change shape from one
    micro-batch or step to the next (packed / variable-length sequences; pass
    pre-cut micro-batches as :class:`~stagewise.MicroBatches`); each value then
    carries its shapes. Off, shapes are learned on the first step and a later
    change is an error naming the stage and tensor. ``transport``: ``"auto"``
    (shared memory when every rank is on this host and the group is gloo, else
    torch.distributed), ``"shm"``, ``"torch"``, or a factory
    ``TransportSpec -> Transport`` (:mod:`stagewise.runtime.comm.transport.choose`);
    unset, ``STAGEWISE_TRANSPORT`` may name one, else ``"auto"``. ``nan_policy``: a
    non-finite loss or gradient anywhere in the mesh either raises on every
    rank before any optimizer steps (``"raise"``) or skips the step on every
    rank, counted in :attr:`skipped_steps` (``"skip"``); ``None`` checks
    nothing (see :mod:`stagewise.runtime.features.finite`).
    ``emulate_slowdown`` (an EMULATION of heterogeneous devices, for experiments
    on one machine): a factor f >= 1, or one per rank of the group; after each
    compute action (F, B, I, W) the rank sleeps (f - 1) x the action's measured
    time, so it looks f times slower and takes no CPU from the others.

    ``parallel``: a :class:`~stagewise.ParallelConfig` (or a built
    :class:`~stagewise.Mesh`) for pipeline x data x ZeRO-sharded x tensor
    parallelism: the schedule runs on the mesh's ``pp`` group (so ``group``
    must be None), stages are replicated over ``dp`` and sharded over
    ``sharding`` (gradients reduced at each stage's SYNC), and the layers that
    ``tp_plan`` names are split over ``tp`` (see :mod:`stagewise.runtime.hybrid.hybrid`).
    Each data-parallel replica trains on its own slice (:meth:`local_batch`).

    ``batchnorm``: ``"micro"`` or ``"deferred"`` (or a
    :class:`~stagewise.BatchNormPolicy`): each micro-batch is normalised with
    its own statistics either way; ``"deferred"`` updates the running
    statistics once per step over the whole batch, ``"micro"`` once per
    micro-batch (:mod:`stagewise.runtime.features.batchnorm`). Left out, ``"micro"``
    applies and a stage holding BatchNorm layers says so once.

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
        transport: TransportChoice = None,
        batchnorm: str | BatchNormPolicy | None = None,
        loss_weights: LossWeights | None = None,
        nan_policy: str | None = "raise",
        emulate_slowdown: float | Sequence[float] | None = None,
    ) -> None:
        super().__init__()
        options = RunOptions(
            loss_fn, optimizer, batch_dim, target_batch_dim, timeout, store, recompute, measure_memory, autocast,
            variable_shapes, transport, batchnorm, loss_weights, nan_policy, emulate_slowdown,
        )  # fmt: skip
        ctx = resolve_context(
            schedule=schedule,
            microbatches=microbatches,
            virtual_stages=virtual_stages,
            group=group,
            parallel=parallel,
            device=device,
            optimizer_steps=options.step_placement,
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
            timeout=options.timeout,
            store=options.store,
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
    def from_hf(cls, model: nn.Module, **options: Any) -> Pipeline:
        """Pipeline a Hugging Face decoder-only causal LM (GPT-2, Llama, Mistral, Qwen2/3), cut among its layers.

        See :func:`stagewise.runtime.frontends.hf.from_hf` for the options; the loss defaults to transformers'.
        """
        from .frontends.hf import from_hf

        return from_hf(cls, model, **options)

    @classmethod
    def from_plan(cls, plan: Any, layers: Layers, **options: Any) -> Pipeline:
        """Run a :class:`~stagewise.Plan` from :func:`stagewise.plan` on ``layers`` (see
        :func:`stagewise.runtime.frontends.plan.pipeline_from_plan`)."""
        from .frontends.plan import pipeline_from_plan

        return pipeline_from_plan(plan, layers, **options)

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
        run = RunOptions(**options)
        ctx = resolve_context(
            schedule=schedule,
            microbatches=microbatches,
            virtual_stages=virtual_stages,
            group=group,
            parallel=parallel,
            device=device,
            optimizer_steps=run.step_placement,
        )
        return cls._from_parts(ctx, given_stages(stages, ctx), run)

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
        """Register the built stages under their names and wrap them in the engine (:mod:`.assembly`)."""
        self.rank, self.num_ranks, self.schedule = ctx.rank, ctx.num_ranks, ctx.schedule
        self.hybrid, self.device, self.options = ctx.hybrid, ctx.device, options
        self.loss_fn, self.batch_dim = options.loss_fn, options.batch_dim
        self.target_batch_dim = options.target_batch_dim
        self.local_stages = ctx.local_stages
        self.eval_schedule = forward_only(self.schedule)  # validated: what eval_step runs
        self.layer_ranges, self.layer_profile, self.model_cut = parts.layer_ranges, parts.profile, parts.model_cut
        self._tied_copies = parts.tied_copies
        parts.register(self)
        engine = build_engine(
            self, ctx, parts, options, tp_plan, self.eval_schedule, on_transport=self._adopt_transport
        )
        self.optimizers, self.tied, self.hooks = engine.optimizers, engine.tied, engine.hooks
        self._mailbox, self._runner = engine.mailbox, engine.runner
        self._runner.finite = finite_check(self, options.nan_policy)
        if self._runner.finite is not None:
            self.hooks.parts.append(self._runner)  # its before_step runs the check at the first STEP
        self._clock_offset = time.time() - time.perf_counter()

    def _wait(self, works: list[Any], what: str) -> None:
        self.transport.wait(works, what)

    def _adopt_transport(self, transport: Transport) -> None:
        """Hold the transport as soon as it exists, so that a constructor failing later still lets it go at exit."""
        self.transport = transport
        lifecycle.release_at_exit(self)

    # ---- public API --------------------------------------------------------
    def train_step(self, inputs: Any = None, targets: Any = None) -> float:
        """One forward and backward of the mini-batch; returns its mean loss on every rank.

        Gradients accumulate into this rank's parameters' ``.grad`` as
        ``loss_fn(model(inputs), targets).backward()`` would in one process.
        ``inputs`` are needed on the rank holding stage 0, ``targets`` on the
        rank holding the last stage; other ranks may pass None.
        """
        if async_table(self.schedule) is not None:
            raise ValueError(
                f"schedule {self.schedule.name!r} is asynchronous: it has no per-step barrier and steps each stage "
                "at its own STEPs; train with train_stream(batches), not train_step"
            )
        return self._runner.guarded(lambda: self._runner.train(inputs, targets))

    def train_stream(self, batches: Iterable[tuple[Any, Any]], steps: int | None = None) -> Iterator[float]:
        """Asynchronous schedules: train on a stream of ``(inputs, targets)`` mini-batches, yielding each one's loss.

        Every rank iterates its own ``batches`` (same length everywhere; a rank
        not holding stage 0 / the last stage may give None for inputs / targets),
        ``steps`` mini-batches at most (None: until the stream ends). The stream is
        run in windows of the schedule's mini-batches; a window boundary drains the
        pipeline (see :mod:`stagewise.runtime.asynchronous.train`). Each mini-batch's
        loss is the mean over its micro-batches, on every rank. (Not ``train``:
        ``nn.Module.train(mode)`` is taken, and ``eval()`` calls it.)
        """
        return train_stream(self, batches, steps)

    def eval_step(self, inputs: Any = None, *, merge_outputs: bool = True) -> Any:
        """Forward only (no autograd graph); the last stage's rank gets the outputs, others None.

        Outputs are concatenated along dim 0, or returned per micro-batch with
        ``merge_outputs=False``.
        """
        return self._runner.guarded(lambda: self._runner.eval(inputs, merge_outputs))

    @property
    def skipped_steps(self) -> int:
        """How many train steps ``nan_policy="skip"`` skipped for non-finite values (alike on every rank)."""
        finite = self._runner.finite
        return 0 if finite is None else finite.skipped

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
            meta={"mode": step.mode if step else None, "num_microbatches": self.schedule.num_microbatches},
            started=self._runner.step_started,
            clock_offset=self._clock_offset,
            group=self.transport.group if gather else None,
            wait=self._wait,
        )

    def reset_shapes(self) -> None:
        """Forget the cached shapes so the next step may use new ones (call on every rank)."""
        self._mailbox.forget_shapes()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> float:
        """Clip the gradients of the whole model - every stage, every mesh axis - to total norm ``max_norm``.

        As ``torch.nn.utils.clip_grad_norm_`` on the one-process model; returns the
        norm before clipping. A collective: call it on every rank, after train_step.
        """
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
        See :mod:`stagewise.runtime.features.memory`.
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
