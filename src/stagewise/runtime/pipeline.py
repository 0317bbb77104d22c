"""``Pipeline``: a model cut into stages over a process group, trained by interpreting a schedule.

Every rank builds the same Pipeline (SPMD). A rank builds only the layers of its own stages; the Pipeline
*is* an ``nn.Module`` holding them under their names in the original model, so ``parameters()``,
``named_parameters()`` and ``state_dict()`` give this rank's share with the keys a one-process model has.

Construction is one path for every way in: the options (:class:`~stagewise.Options`, one validated value)
→ the frontend's refusals and defaults → the schedule (:mod:`.assembly.context`) → the combinations refused
(:mod:`.assembly.combinations`) → every rank built alike (:mod:`.assembly.agreement`) → where it runs (the
mesh's groups) → this rank's parts (the frontend builds them) → :func:`.assembly.assemble.assemble`. The
construction path is the room :mod:`.assembly`; the frontends are in :mod:`.frontends`; none knows this class.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from torch import nn

from ..ir import Timeline
from ..schedules import is_asynchronous
from .assembly.agreement import check_same_build
from .assembly.assemble import Held, assemble
from .assembly.auto_schedule import synthesized
from .assembly.combinations import refuse_no_sync, refuse_options, refuse_parts
from .assembly.context import place, resolve_schedule_for
from .asynchronous.windows import windows_of
from .checkpoint.declared import PipelineState, StateSource
from .comm import groups, lifecycle
from .engine.given_batches import unlike_batches
from .engine.reports import gathered_losses, step_meta, step_timeline, version_report
from .errors import PipelineError
from .features.evaluation import eval_loss
from .features.owned_step import clip_between_steps
from .frontends.first_batch import at_first_batch
from .frontends.from_model import FromModel
from .frontends.given import GivenStages
from .frontends.hf import FromHF
from .frontends.layer_list import LayerList
from .frontends.layers import Layers
from .frontends.parts import Frontend
from .frontends.plan import FromPlan
from .options import Options, check_applicable
from .relayout import Layout, owned_groups, relayout
from .reporting.memory import memory_report
from .reporting.reporter import Reporter
from .standing import Standing

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from ..planning import Plan
    from .options import PipelineOptions


class Pipeline(Standing, nn.Module):
    """A model pipelined over the ranks of a process group by a schedule.

    ``layers``: an ``nn.Sequential``, a list (or dict) of modules, or of :class:`~stagewise.Layer` specs
    built lazily, each seeded with ``seed + layer index`` (so :func:`~stagewise.build_model` with the same
    seed is the one-process twin). Other ways in: :meth:`from_model`, :meth:`from_hf`, :meth:`from_stages`,
    :meth:`from_plan`; all take the same options, as keywords or an :class:`~stagewise.Options`, where each
    is documented once (what runs, where, how it is cut, how it trains).

    Every schedule trains a stream of mini-batches with :meth:`train_stream`; synchronous ones also one
    mini-batch at a time with :meth:`train_step` (asynchronous ones, ``pipedream``, ``pipedream-2bw``,
    ``xpipe``, step each stage at its own STEPs and have no per-step barrier). Every rank must build its
    Pipelines in the same order.
    """

    def __init__(
        self, layers: Layers | Frontend, options: Options | None = None, /, **keywords: Unpack[PipelineOptions]
    ) -> None:
        super().__init__()
        before = groups.registered()  # the groups the build makes are this pipeline's (close() destroys them)
        frontend: Frontend = layers if isinstance(layers, Frontend) else LayerList(layers)
        entry = frontend.entry
        opts = Options.of(entry, options, keywords)
        check_applicable(entry, frontend.refused, opts)
        opts = synthesized(entry, frontend, frontend.defaults(opts))  # schedule="auto": synthesized for the costs
        schedule = resolve_schedule_for(opts, frontend.stage_count(opts))
        refuse_options(entry, opts, schedule)
        check_same_build(entry, opts, schedule, getattr(frontend, "model", None))  # before any group: alike, or refused
        ctx = place(opts, schedule)
        parts = frontend.build(ctx, opts)
        refuse_parts(entry, opts, schedule, parts)
        self._pp_rank, self._num_ranks, self.schedule = ctx.rank, ctx.num_ranks, ctx.schedule
        self._process_rank, self._local_stages = groups.global_rank(), ctx.local_stages
        self.hybrid, self.device, self.options, self.frontend = ctx.hybrid, ctx.device, opts, frontend
        self.layer_ranges, self.layer_profile, self.model_cut = parts.layer_ranges, parts.profile, parts.model_cut
        self._tied_copies, self._aliases = parts.tied_copies, parts.aliases
        self._held = Held()
        lifecycle.release_at_exit(self._held)  # a constructor failing later still lets go of its groups at exit
        engine = assemble(self, ctx, parts, opts, self._held)
        self._held.made = groups.made_since(before)
        self.transport, self.optimizers, self.tied = engine.transport, engine.optimizers, engine.tied
        self.hooks, self.eval_schedule, self.schedulers = engine.hooks, engine.eval_schedule, engine.schedulers
        self.snapshots = engine.snapshots  # snapshot=: resumed by sw.checkpoint.resume (or None)
        self._batches_checked = False  # (engine.given_batches, on the first train step)
        self.replanned_cut: list[int] | None = None  # a Replanner's cut, once it moved one (checkpoints record it)
        self.prior_wanted = False  # a RunCalibrator's ask: the layers priced at the first batch (first_batch._prior)
        self._engine, self._clock_offset = engine, time.time() - time.perf_counter()

    # ---- other ways in ------------------------------------------------------
    @classmethod
    def from_model(cls, model: nn.Module, /, **options: Unpack[PipelineOptions]) -> Pipeline:
        """Pipeline an unmodified ``nn.Module``, cut at its ``pipeline_stage`` tags or among its top-level blocks
        (see :mod:`stagewise.runtime.frontends.from_model`)."""
        return cls(FromModel(model), **options)

    @classmethod
    def from_hf(
        cls, model: nn.Module, /, *, check: bool = True, plan: Plan | None = None, **options: Unpack[PipelineOptions]
    ) -> Pipeline:
        """Pipeline a Hugging Face decoder-only causal LM, cut among its decoder layers; the loss defaults to
        transformers' (see :mod:`stagewise.runtime.frontends.hf`).

        ``check``: before anything is placed, the model's pieces are chained in one process on a tiny batch
        and compared with the model's own forward; a model whose pieces differ is refused, naming where.
        ``check=False`` skips it, for a model too big to run once in one process. ``plan``: a plan of
        ``sw.profile(model, ...)``, run as :meth:`from_plan` runs it.
        """
        return cls(FromHF(model, check=check) if plan is None else FromPlan(plan, model, check=check), **options)

    @classmethod
    def from_stages(
        cls, modules: Mapping[int, nn.Module | Sequence[nn.Module]], /, **options: Unpack[PipelineOptions]
    ) -> Pipeline:
        """Bring your own stages: ``modules[s]`` is the module (or modules, applied in order) of stage ``s``.

        Each rank passes the stages it holds (``schedule.stages_of(rank)``), already built, on its device;
        they are registered as ``stage{s}``.
        """
        return cls(GivenStages(modules), **options)

    @classmethod
    def from_plan(cls, plan: Plan, layers: Layers, /, **options: Unpack[PipelineOptions]) -> Pipeline:
        """Run a :class:`~stagewise.Plan` from :func:`stagewise.plan` on ``layers``: the plan sets the layout and
        the schedule, the options everything else (see :mod:`stagewise.runtime.frontends.plan`)."""
        return cls(FromPlan(plan, layers), **options)

    # ---- training -----------------------------------------------------------
    def train_step(self, inputs: Any = None, targets: Any = None) -> float:
        """One forward and backward of the mini-batch; returns its mean loss on every rank.

        Gradients accumulate into this rank's parameters' ``.grad`` as
        ``loss_fn(model(inputs), targets).backward()`` would in one process. ``inputs`` are needed on the
        rank holding stage 0, ``targets`` on the rank holding the last stage; other ranks may pass None.
        """
        if is_asynchronous(self.schedule):
            raise ValueError(
                f"schedule {self.schedule.name!r} is asynchronous: it has no per-step barrier and steps each stage "
                "at its own STEPs; train with train_stream(batches), not train_step"
            )
        return self._train([(inputs, targets)])[0]

    def _train(self, batches: list[tuple[Any, Any]]) -> list[float]:
        """One train step (a synchronous schedule's mini-batch, or an asynchronous window), counted by the
        gradient merge: a step refused for non-finite values dropped every merged step's gradients."""
        at_first_batch(self, batches)  # the default cut without sample inputs: counted on the first batch
        runner, merge = self._engine.runner, self._engine.merge

        def train() -> list[float]:
            if not self._batches_checked:  # the first train step: were the ranks given one batch?
                self._batches_checked = True
                unlike_batches(*batches[0], self.transport.group, self.transport.guard.wait)
            return runner.train(batches)

        try:
            losses: list[float] = runner.guarded(train, "train_step")
        except PipelineError:
            merge.dropped()
            raise
        merge.stepped()
        runner.raise_late()  # an LR scheduler's error, the step done and counted
        return losses

    def relayout(self, members: Sequence[int] | None = None, /, *, plan: Plan | None = None, **changes: Any) -> Layout:
        """New layout options (or ``plan=``) in place, exactly, on ``members`` (global ranks; default all): a collective
        (:mod:`.relayout.call`); ``live=``: ranks whose live tensors are sources (the rest: this step's snapshots)."""
        live = changes.pop("live", None)
        return relayout(self, members, changes, plan, lambda frontend, options: Pipeline(frontend, options), live)

    def no_sync(self) -> AbstractContextManager[None]:
        """Gradient merge: inside ``with pipe.no_sync():`` train steps only accumulate gradients.

        As ``DistributedDataParallel.no_sync``: a stage's SYNC starts no reduction (data-parallel, sharded,
        tied) and STEP steps no optimizer, until the first ``train_step`` outside the block, which reduces the
        gradients of every merged step once and steps (see :mod:`stagewise.runtime.features.merge`). Call it
        on every rank alike. Asynchronous schedules refuse it.
        """
        refuse_no_sync("Pipeline", self.schedule)
        return self._engine.merge.no_sync()

    @property
    def train_steps(self) -> int:
        """Mini-batches this pipeline has trained (each train_step, each of a stream's): the step of the dropout
        masks' seeds. A checkpoint saves it and a load sets it, so a resumed run draws the masks it would have."""
        return self._engine.runner.trained

    @train_steps.setter
    def train_steps(self, value: int) -> None:
        self._engine.runner.trained = int(value)

    @property
    def dropout_seed(self) -> int:
        """The seed of the dropout masks: the ``dropout_seed`` option (else ``seed``), or a loaded checkpoint's."""
        seeds = self._engine.dropout
        assert seeds is not None
        return seeds.seed

    @dropout_seed.setter
    def dropout_seed(self, value: int) -> None:
        seeds = self._engine.dropout
        assert seeds is not None
        seeds.seed = int(value)

    @property
    def merged_steps(self) -> int:
        """Train steps whose gradients are accumulated in a gradient merge, not yet reduced (0 outside one)."""
        return self._engine.merge.pending

    @property
    def committed_step(self) -> int | None:
        """``snapshot=``: the newest step held on two machines, never lost while one copy survives (guides/elastic)."""
        return None if self.snapshots is None else self.snapshots.committed

    def train_stream(self, batches: Iterable[tuple[Any, Any]], steps: int | None = None) -> Iterator[float]:
        """Train on a stream of ``(inputs, targets)`` mini-batches, yielding each one's loss (any schedule).

        Every rank iterates its own ``batches`` (same length everywhere; a rank not holding stage 0 / the last
        stage may give None for inputs / targets), ``steps`` mini-batches at most (None: until the stream
        ends). A synchronous schedule trains them step after step, as :meth:`train_step` does (the optimizer
        steps through ``optimizer=``, or between the mini-batches as the caller consumes them). An asynchronous
        one runs the stream in windows of the schedule's mini-batches; a window boundary drains the pipeline
        (see :mod:`stagewise.runtime.asynchronous.windows`). Each mini-batch's loss is the mean over its
        micro-batches, on every rank. (Not ``train``: ``nn.Module.train(mode)`` is taken.)
        """
        if steps is not None and steps < 0:
            raise ValueError(f"train_stream: steps must be >= 0 or None, got {steps}")
        return self._stream(iter(batches), steps)

    def _stream(self, stream: Iterator[tuple[Any, Any]], steps: int | None) -> Iterator[float]:
        for window in windows_of(stream, self._engine.runner.lists.size, steps):  # one mini-batch a step if sync
            yield from self._train(window)

    def eval_step(self, inputs: Any = None, *, merge_outputs: bool = True) -> Any:
        """Forward only (no autograd graph); the last stage's rank gets the outputs, others None: concatenated
        along dim 0, or per micro-batch with ``merge_outputs=False``."""
        runner = self._engine.runner
        return runner.guarded(lambda: runner.eval(inputs, merge_outputs), "eval_step")

    def eval_loss(self, inputs: Any = None, targets: Any = None) -> float:
        """``loss_fn(model(inputs), targets)``, forward only, over every replica, on every rank (a collective)."""
        return eval_loss(self, inputs, targets)

    def local_batch(self, inputs: Any = None, targets: Any = None, *, uneven: bool = False) -> tuple[Any, Any]:
        """This rank's data-parallel share of a global batch (all of it without ``parallel=``); ``uneven=True``:
        ``tensor_split``'s shares, for an evaluation (``eval_loss`` weights them; a train step needs equal ones)."""
        if self.hybrid is None:
            return inputs, targets
        h, o, u = self.hybrid, self.options, uneven
        return h.local_batch(inputs, o.batch_dim, "inputs", u), h.local_batch(targets, o.target_batch_dim, "targets", u)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> float:
        """Clip the gradients of the whole model - every stage, every mesh axis - to total norm ``max_norm``.

        As ``torch.nn.utils.clip_grad_norm_`` on the one-process model; returns the norm before clipping.
        A collective: call it on every rank, after train_step (in a gradient merge, after the train_step
        that ends it: the norm is the merged gradient's).
        """
        return clip_between_steps(self, self._engine.merge, max_norm, norm_type)

    def register_sync_hook(self, hook: Callable[[int], None]) -> None:
        """Call ``hook(stage)`` at each SYNC action, once the stage's gradients are final."""
        self.hooks.user.append(hook)

    def reset_shapes(self) -> None:
        """Forget the cached shapes so the next step may use new ones (call on every rank)."""
        self._engine.mailbox.forget_shapes()

    # ---- what a step left -----------------------------------------------------
    @property
    def skipped_steps(self) -> int:
        """How many train steps ``nan_policy="skip"`` skipped for non-finite values (alike on every rank)."""
        return 0 if self._engine.finite is None else self._engine.finite.skipped

    @property
    def tied_copies(self) -> dict[str, nn.Module]:
        """Tied modules this rank holds only for a later use, by their first use's one-process name (they are
        not in ``state_dict()``: that is saved where the first use is; checkpoints load them too)."""
        return dict(self._tied_copies)

    def state_sources(self) -> list[StateSource]:
        """Where a resume may take this pipeline's state from besides the disk (:mod:`.checkpoint.declared`)."""
        return [] if self.snapshots is None else [self.snapshots.source(self)]

    @property
    def last_step(self) -> Any:
        """The last step's record (its events, per-kind compute times, mode), or None before the first."""
        return self._engine.runner.last_step

    @property
    def clock_offset(self) -> float:
        """``time.time() - time.perf_counter()`` on this process: what puts its step's events on the wall clock."""
        return self._clock_offset

    def timeline(self, gather: bool = False, mode: str = "train") -> Timeline:
        """What this rank executed in the last train step (``mode="eval"``: the last eval_step), seconds from its
        start, as a measured Timeline.

        With ``gather=True`` (a collective: call it on every rank) the events of all ranks are collected,
        on one clock, so the step renders like a simulated one.
        """
        events, started = self.metrics.last_run(mode)
        return step_timeline(
            events or [], rank=self.rank, num_ranks=self.num_ranks, name=self.schedule.name,
            meta=step_meta(mode, events is not None, self.schedule.num_microbatches),
            started=started, clock_offset=self._clock_offset, group=self.transport.group if gather else None,
            wait=self.transport.guard.wait,
        )  # fmt: skip

    @property
    def metrics(self) -> Reporter:
        """What this pipeline reports: ``.event(name, **fields)``, ``.watch(optimizer)``, ``.log(**values)``."""
        return self._engine.reporter

    def last_step_losses(self) -> dict[str, float]:
        """The last train_step's losses: ``{"loss": main, "aux": sum of aux terms, "aux/NAME": each}``.

        Aux terms are summed over micro-batches (each weighted ``1/m``) and over all ranks. A collective:
        call it on every rank.
        """
        losses = self._engine.runner.losses
        loss = losses[-1] if losses else float("nan")
        return gathered_losses(loss, self._engine.aux.last, self.transport.group, self.transport.guard.wait)

    def memory_report(self) -> dict[str, Any]:
        """This rank's bytes as the planner counts them (``plan.memory[rank]``): ``parameters``, ``gradients``,
        ``optimizer`` (the device-held state of ``optimizer=``'s and ``metrics.watch``-ed optimizers),
        ``activations`` (None without ``measure_memory=True``, which adds ``peak_bytes``, ``forward_bytes``,
        ``weight_bytes``), ``total``; with ``offload=`` ``host``: :mod:`stagewise.runtime.reporting.memory`."""
        optimizers = [*self.optimizers.values(), *self.metrics.watched]
        return memory_report(list(self.parameters()), optimizers, self._engine.meter, self._engine.offload)

    def version_report(self) -> dict[int, dict[str, int]]:
        """Asynchronous schedules: per local stage, the most weight snapshots held at once over every window so
        far (``peak_snapshots``, the current weights' copy included) and their bytes (``peak_bytes``); the
        simulator's count is :func:`stagewise.asynchronous.live_versions`."""
        return version_report(self._engine.versions, self.schedule.name)

    # ---- nn.Module ------------------------------------------------------------
    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters under their one-process names; a tied module held here only for a later use is
        reported under its first use's name (it is not in ``state_dict()``: that is saved where the first use is)."""
        for name, p in super().named_parameters("", recurse, remove_duplicate):
            yield (f"{prefix}." if prefix else "") + self._aliases.get(name, name), p
        for name, module in self._tied_copies.items():
            yield from module.named_parameters(f"{prefix}.{name}" if prefix else name, recurse, remove_duplicate)

    def close(self) -> None:
        """Let go of this pipeline's threads and process groups now, not at exit (a process building one after
        another); it trains no more, its parameters stay. Call it on every rank (``contextlib.closing`` works)."""
        lifecycle.close_now(self._held, self._engine.runner, self.snapshots, owned_groups(self))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("a Pipeline is not called directly: use train_step(inputs, targets) or eval_step(inputs)")

    def __del__(self) -> None:
        held = self.__dict__.get("_held")
        if held is not None:
            held.close()


if TYPE_CHECKING:
    _declares: type[PipelineState] = Pipeline  # mypy checks that a Pipeline declares its state
