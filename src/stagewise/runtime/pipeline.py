"""``Pipeline``: a model cut into stages over a process group, trained by interpreting a schedule.

Every rank builds the same Pipeline (SPMD). A rank builds only the layers of
its own stages; the Pipeline *is* an ``nn.Module`` holding them under their
names in the original model, so ``parameters()``, ``named_parameters()`` and
``state_dict()`` give this rank's share with the keys a one-process model has.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from ..actions import Action, Kind, parse_action
from ..passes import lower
from ..schedule import Schedule
from ..schedules import schedule_info
from ..timeline import Event, Timeline
from ..validate import validate_schedule
from . import transport as tp
from .aux import attach, collect_aux_losses
from .balance import plan_layers
from .batchnorm import BatchNormPolicy, attach_batchnorms, check_batchnorm
from .errors import PipelineError
from .forensics import position
from .interpreter import Interpreter, Step
from .layers import Layers, Partition, named_layers
from .memory import ActivationMeter
from .messages import Mailbox
from .microbatch import Dims, merge, split
from .precision import autocast_context, autocast_loss, check_autocast
from .recompute import Recompute, check_recompute, run_layers
from .tied import TiedBuilder, TiedSync, stage_parameters

log = logging.getLogger(__name__)

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


class _Stage:
    """The layers of one stage, applied in order under the calling convention (checkpointed if ``recompute``).

    While training, the :func:`~stagewise.aux_loss` terms its layers add are
    summed, scaled by ``aux_scale`` and carried on its outputs (:mod:`.aux`);
    their detached values accumulate into ``aux_totals``.
    """

    def __init__(
        self, index: int, modules: list[nn.Module], recompute: Recompute = None, precision: Any = nullcontext
    ) -> None:
        self.index = index
        self.precision = precision  # a context factory: autocast, or nothing (see .precision)
        self.modules = modules
        self.recompute = recompute
        self.aux_scale = 1.0
        self.aux_totals: dict[str, float] = {}

    def __call__(self, x: Any) -> Any:
        with self.precision():
            return self._run(x)

    def _run(self, x: Any) -> Any:
        if not torch.is_grad_enabled():
            return run_layers(self.modules, x, None)
        with collect_aux_losses() as terms:
            out = run_layers(self.modules, x, self.recompute)
        if not terms:
            return out
        for name, value in terms:
            self.aux_totals[name] = self.aux_totals.get(name, 0.0) + float(value.detach()) * self.aux_scale
        total = torch.stack([v for _, v in terms]).sum() * self.aux_scale
        return attach(out, total, self.index)


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
    layer at a time (:mod:`stagewise.runtime.balance`). ``speeds`` and
    ``memory_caps`` (bytes), one per rank, describe heterogeneous ranks: a rank
    at speed 0.5 gets about half the work, none holds more than its cap.
    ``loss_fn(output, target)`` must return the micro-batch's *mean* loss; each
    micro-batch's loss is weighted by its share of the batch, so a step's
    gradients are those of the mean loss over the whole batch. ``optimizer``:
    an optional factory ``params -> Optimizer``, one per stage, stepped (and
    zeroed) by the schedule's STEP actions, or after the step if it has none.
    ``batch_dim`` / ``target_batch_dim``: where the batch dim of the inputs /
    targets is (see :mod:`stagewise.runtime.microbatch`). ``timeout``: seconds
    any wait may take before every rank raises :class:`PipelineError`; the
    error names, on each rank, the action it was in and what it waited for
    (:mod:`stagewise.runtime.forensics`). ``autocast``: ``torch.bfloat16`` (or
    ``float16``) runs each stage's forward and the loss under
    ``torch.autocast`` (:mod:`stagewise.runtime.precision`).
    ``variable_shapes``: values between stages may change shape from one
    micro-batch or step to the next (packed / variable-length sequences; pass
    pre-cut micro-batches as :class:`~stagewise.MicroBatches`); each value then
    carries its shapes. Off, shapes are learned on the first step and a later
    change is an error naming the stage and tensor.

    ``parallel``: a :class:`~stagewise.ParallelConfig` (or a built
    :class:`~stagewise.Mesh`) for pipeline x data x ZeRO-sharded x tensor
    parallelism: the schedule runs on the mesh's ``pp`` group (so ``group``
    must be None), stages are replicated over ``dp`` and sharded over
    ``sharding`` (gradients reduced at each stage's SYNC), and the layers that
    ``tp_plan`` names are split over ``tp`` (see :mod:`stagewise.runtime.parallel`).
    Each data-parallel replica trains on its own slice (:meth:`local_batch`).

    ``batchnorm``: ``"micro"`` or ``"deferred"`` (or a
    :class:`~stagewise.BatchNormPolicy`): each micro-batch is normalised with
    its own statistics either way; ``"deferred"`` updates the running
    statistics once per step over the whole batch, ``"micro"`` once per
    micro-batch (:mod:`stagewise.runtime.batchnorm`). Left out, ``"micro"``
    applies and a stage holding BatchNorm layers says so once.

    Every rank of the group must build its Pipelines in the same order.
    """

    def __init__(
        self,
        layers: Layers,
        *,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        schedule: str | Schedule = "1f1b",
        microbatches: int | None = None,
        virtual_stages: int | None = None,
        partition: Partition = "uniform",
        sample_inputs: Any = None,
        speeds: Sequence[float] | None = None,
        memory_caps: Sequence[float] | None = None,
        group: Any = None,
        parallel: Any = None,
        tp_plan: Any = None,
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
        batchnorm: str | BatchNormPolicy | None = None,
    ) -> None:
        super().__init__()
        norm_policy = check_batchnorm(batchnorm)
        tp.require_initialized()
        self.hybrid = _hybrid(parallel, group)  # pp x dp x sharding x tp: the schedule runs on the pp group
        group = tp.group_or_world(group if self.hybrid is None else self.hybrid.pp_group)
        self.rank = tp.group_rank(group)
        self.num_ranks = tp.group_size(group)
        self.schedule = _resolve_schedule(schedule, self.num_ranks, microbatches, virtual_stages)
        self.loss_fn = loss_fn
        self.batch_dim = batch_dim
        self.target_batch_dim = target_batch_dim
        check_recompute(recompute)
        self.recompute = recompute
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if tp.backend_of(group) == "nccl" else "cpu"
        self.device = torch.device(device)
        check_autocast(autocast)
        self.autocast = autocast
        self._precision = autocast_context(autocast, self.device)

        named = named_layers(layers)
        plan = plan_layers(
            named,
            self.schedule,
            partition,
            group=group if self.hybrid is None else None,  # every pp group of a mesh must cut alike
            device=self.device,
            seed=seed,
            sample_inputs=sample_inputs,
            speeds=speeds,
            memory_caps=memory_caps,
        )
        self.layer_profile = plan.profile
        self._tied_builder = TiedBuilder(named, seed, self.device)
        if self.hybrid is not None and self.hybrid.config.tp > 1:
            self._tied_builder.check_plan([n for n, _ in named], tp_plan)
        stages = self._build_stages(named, plan.ranges, seed)
        if self.hybrid is not None:  # split, shard or replicate the stages before optimizers see them
            wait = lambda works, what: self.transport.wait(works, what)  # noqa: E731
            whole = {id(p) for m in self._tied_builder.built.values() for p in m.parameters()}
            self.hybrid.attach(self, {s: st.modules for s, st in stages.items()}, tp_plan, wait, whole)
        self.optimizers = _optimizers(stages, optimizer)
        self._train_actions = self._with_steps(self.schedule.ranks[self.rank], optimizer is not None)
        self._eval_actions = tuple(
            a for a in self.schedule.ranks[self.rank] if a.kind in (Kind.F, Kind.SEND_F, Kind.RECV_F)
        )
        name, pipeline_id = tp.next_pipeline_id(group)
        board = name if self.hybrid is None else self.hybrid.board_name()  # a failure anywhere stops the whole mesh
        self.transport = tp.Transport(
            group,
            name=name,
            pipeline_id=pipeline_id,
            timeout=timeout,
            store=store,
            side=tp.side_group(group),
            board=board,
            label=None if self.hybrid is None else f"rank {self.rank} ({self.hybrid.mesh.where()})",
        )
        self.transport.warm_up()
        tp.release_at_exit(self)
        self._mailbox = Mailbox(
            self.transport,
            self.schedule.placement,
            self.schedule.num_microbatches,
            self.device,
            variable_shapes=variable_shapes,
        )
        self._sync_hooks: list[Callable[[int], None]] = []
        if self.hybrid is not None:
            self.register_sync_hook(self.hybrid.on_sync)
        self.tied = TiedSync(
            self._tied_builder,
            self.layer_ranges,
            self.schedule.placement,
            self.rank,
            group,
            lambda works, what: self.transport.wait(works, what),
            mesh=None if self.hybrid is None else self.hybrid.mesh,
        )
        self.register_sync_hook(self.tied.on_sync)
        self._stages = stages
        for st in stages.values():
            st.aux_scale = 1.0 / self.schedule.num_microbatches
        self._losses: dict[str, Any] = {}
        self._meter: ActivationMeter | None = None
        if measure_memory:
            self._meter = ActivationMeter(self.parameters(), lambda: self._interpreter.current)
        self._interpreter = Interpreter(
            rank=self.rank,
            placement=self.schedule.placement,
            stages=dict(stages),
            loss_fn=autocast_loss(loss_fn, self._precision),
            transport=self.transport,
            mailbox=self._mailbox,
            step_stage=self._step_optimizer,
            sync_hooks=self._sync_hooks,
        )
        self._norms = attach_batchnorms(self, norm_policy, {s: st.modules for s, st in stages.items()})
        self._last_step: Step | None = None
        self._running: tuple[Action, ...] = ()
        self._step_started = 0.0
        self._clock_offset = time.time() - time.perf_counter()

    def _build_stages(self, named: list[tuple[str, Any]], ranges: list[range], seed: int) -> dict[int, _Stage]:
        """Build this rank's layers only, registered under their names in the original model."""
        self.layer_ranges = ranges
        self.local_stages = self.schedule.stages_of(self.rank)
        stages: dict[int, _Stage] = {}
        self._tied_copies: dict[str, nn.Module] = {}  # first-use name -> tied module whose first use is elsewhere
        for s in self.local_stages:
            modules = []
            for k in self.layer_ranges[s]:
                name, layer = named[k]
                if hasattr(self, name) and name not in self._modules:
                    raise ValueError(f"layer name {name!r} clashes with a Pipeline attribute; rename the layer")
                module = self._tied_builder.build(layer, k)
                self.add_module(name, module)
                modules.append(module)
            stages[s] = _Stage(s, modules, self.recompute, self._precision)
        for key, (_, name0, _) in self._tied_builder.first.items():
            if key in self._tied_builder.built and name0 not in self._modules:
                self._tied_copies[name0] = self._tied_builder.built[key]
        log.info(
            "stagewise: rank %d holds stages %s (layers %s) of schedule %r",
            self.rank,
            list(self.local_stages),
            [f"{r.start}..{r.stop - 1}" for r in (self.layer_ranges[s] for s in self.local_stages)],
            self.schedule.name,
        )
        return stages

    @classmethod
    def from_model(cls, model: nn.Module, **options: Any) -> Pipeline:
        """Pipeline an unmodified ``nn.Module``, cut at its ``pipeline_stage`` tags or among its blocks.

        See :func:`stagewise.runtime.from_model.from_model` for the options
        (``stages``, ``partition``, ``sample_inputs``, ``speeds``,
        ``memory_caps``, ``free_unused``, ``concrete_args``, and every
        Pipeline option but ``seed``).
        """
        from .from_model import from_model

        return from_model(cls, model, **options)

    # ---- public API --------------------------------------------------------
    def train_step(self, inputs: Any = None, targets: Any = None) -> float:
        """One forward and backward of the mini-batch; returns its mean loss on every rank.

        Gradients accumulate into this rank's parameters' ``.grad`` as
        ``loss_fn(model(inputs), targets).backward()`` would in one process.
        ``inputs`` are needed on the rank holding stage 0, ``targets`` on the
        rank holding the last stage; other ranks may pass None.
        """
        return self._guarded(lambda: self._train(inputs, targets))

    def eval_step(self, inputs: Any = None, *, merge_outputs: bool = True) -> Any:
        """Forward only (no autograd graph); the last stage's rank gets the outputs, others None.

        Outputs are concatenated along dim 0, or returned per micro-batch with
        ``merge_outputs=False``.
        """
        return self._guarded(lambda: self._eval(inputs, merge_outputs))

    def timeline(self, gather: bool = False) -> Timeline:
        """What this rank executed in the last step (seconds from its start) as a measured Timeline.

        With ``gather=True`` (a collective: call it on every rank) the events of
        all ranks are collected, on one clock, so the step renders like a
        simulated one.
        """
        step = self._last_step
        events = [] if step is None else step.events
        name = self.schedule.name
        meta = {"mode": step.mode if step else None, "microbatches": self.schedule.num_microbatches}
        if not gather:
            base = self._step_started
            local = [Event(self.rank, a, t0 - base, t1 - base) for a, t0, t1 in events]
            return Timeline(name, self.num_ranks, local, source="measured", unit="s", meta=meta)
        wall = [(str(a), t0 + self._clock_offset, t1 + self._clock_offset) for a, t0, t1 in events]
        everyone = tp.gather_objects((self.rank, wall), self.transport.group)
        starts = [t0 for _, rows in everyone for _, t0, _ in rows]
        base = min(starts) if starts else 0.0
        merged = [Event(rank, parse_action(a), t0 - base, t1 - base) for rank, rows in everyone for a, t0, t1 in rows]
        merged.sort(key=lambda e: (e.rank, e.start))
        return Timeline(name, self.num_ranks, merged, source="measured", unit="s", meta=meta)

    def reset_shapes(self) -> None:
        """Forget the cached shapes so the next step may use new ones (call on every rank)."""
        self._mailbox.forget_shapes()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> float:
        """Clip the gradients of the whole model - every stage, every mesh axis - to total norm ``max_norm``.

        As ``torch.nn.utils.clip_grad_norm_`` on the one-process model; returns the
        norm before clipping. A collective: call it on every rank, after train_step.
        """
        from .parallel import clip_pipeline_grads

        return clip_pipeline_grads(self, max_norm, norm_type)

    def local_batch(self, inputs: Any = None, targets: Any = None) -> tuple[Any, Any]:
        """This rank's data-parallel share of a global batch (all of it without ``parallel=``)."""
        if self.hybrid is None:
            return inputs, targets
        h = self.hybrid
        return h.local_batch(inputs, self.batch_dim, "inputs"), h.local_batch(targets, self.target_batch_dim, "targets")

    def register_sync_hook(self, hook: Callable[[int], None]) -> None:
        """Call ``hook(stage)`` at each SYNC action, once the stage's gradients are final."""
        self._sync_hooks.append(hook)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True) -> Any:
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
        everyone = tp.gather_objects(self._losses.get("aux_local", {}), self.transport.group)
        names = sorted({n for d in everyone for n in d})
        per = {n: sum(d.get(n, 0.0) for d in everyone) for n in names}
        out = {"loss": self._losses.get("loss", float("nan")), "aux": sum(per.values())}
        out.update({f"aux/{n}": v for n, v in per.items()})
        return out

    def memory_report(self) -> dict[str, Any]:
        """Activation bytes of the last train_step on this rank (needs ``measure_memory=True``).

        ``peak_bytes``: most bytes saved for backward alive at once;
        ``forward_bytes``: ``{(stage, microbatch): bytes its F saved}``;
        ``weight_bytes``: ``{(stage, microbatch): bytes of those still alive when its W started}``
        (zero-bubble schedules only).
        See :mod:`stagewise.runtime.memory`.
        """
        if self._meter is None:
            raise ValueError("build the Pipeline with measure_memory=True to measure activation memory")
        meter = self._meter
        return {
            "peak_bytes": meter.peak,
            "forward_bytes": dict(meter.by_forward),
            "weight_bytes": dict(meter.by_weight),
        }

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("a Pipeline is not called directly: use train_step(inputs, targets) or eval_step(inputs)")

    # ---- steps -------------------------------------------------------------
    def _guarded(self, body: Callable[[], Any]) -> Any:
        if self.transport.failure is not None:
            raise PipelineError(f"the pipeline failed earlier and cannot run again: {self.transport.failure}")
        try:
            return body()
        except PipelineError as err:
            raise PipelineError(f"{err}\n{self._position()}") from err
        except BaseException as err:
            self.transport.fail(f"{self.transport.me}: {type(err).__name__}: {err}\n{self._position()}")
            raise

    def _position(self) -> str:
        """Where this rank stood in the action list it was running (see :mod:`.forensics`)."""
        step, it = self._last_step, self._interpreter
        done = step.events[-1][0] if step is not None and step.events else None
        actions = self._running
        return position(self.rank, actions, getattr(it, "current", None), done, self.transport.waiting)

    def _train(self, inputs: Any, targets: Any) -> float:
        step = self._prepare("train", inputs, targets)
        loss_recv = self._post_loss_receive()
        self.tied.start_step()
        for st in self._stages.values():
            st.aux_totals = {}
        if self._meter is None:
            self._run(self._train_actions, step)
        else:
            self._meter.reset()
            with self._meter.hooks():
                self._run(self._train_actions, step)
        self.tied.finish()
        loss = self._share_loss(step, loss_recv)
        aux_local: dict[str, float] = {}
        for st in self._stages.values():
            for n, v in st.aux_totals.items():
                aux_local[n] = aux_local.get(n, 0.0) + v
        if self.hybrid is not None:  # wait for the gradient reductions; the mean over the replicas
            last = self.rank == self.schedule.placement[-1]
            loss = self.hybrid.after_train(loss, targets if last else None, self.target_batch_dim)
        self._losses = {"loss": loss, "aux_local": aux_local}
        return loss

    def _eval(self, inputs: Any, merge_outputs: bool) -> Any:
        step = self._prepare("eval", inputs, None)
        with torch.no_grad():
            self._run(self._eval_actions, step)
        if self.hybrid is not None:
            self.hybrid.after_eval()
        if self.schedule.placement[-1] != self.rank:
            return None
        outputs = [step.outputs[i] for i in range(self.schedule.num_microbatches)]
        return merge(outputs) if merge_outputs else outputs

    def _run(self, actions: tuple[Action, ...], step: Step) -> None:
        self._last_step, self._running = step, actions
        self._step_started = time.perf_counter()
        with self._norms.step(step.mode):
            self._interpreter.run(actions, step)
        self.transport.finish_sends()

    def _prepare(self, mode: str, inputs: Any, targets: Any) -> Step:
        m = self.schedule.num_microbatches
        first, last = self.schedule.placement[0], self.schedule.placement[-1]
        step = Step(mode, None, None, None)
        sizes = None
        if self.rank == first:
            if inputs is None:
                raise ValueError(f"rank {self.rank} holds stage 0, so {mode}_step needs the inputs")
            chunks, sizes = split(inputs, m, self.batch_dim, "inputs")
            step.inputs = [_to(c, self.device) for c in chunks]
        if mode == "train" and self.rank == last:
            if targets is None:
                raise ValueError(f"rank {self.rank} holds the last stage, so train_step needs the targets")
            if self.loss_fn is None:
                raise ValueError("train_step needs a loss: build the Pipeline with loss_fn=...")
            chunks, target_sizes = split(targets, m, self.target_batch_dim, "targets")
            if sizes is not None and sizes != target_sizes:
                raise ValueError(f"inputs and targets disagree on the batch size: {sum(sizes)} vs {sum(target_sizes)}")
            step.targets = [_to(c, self.device) for c in chunks]
            total = sum(target_sizes)
            step.weights = [n / total for n in target_sizes]
        return step

    def _post_loss_receive(self) -> tuple[torch.Tensor, list[Any], Any] | None:
        """On gloo, post (and watch) the loss's receive before the step: the loss travels as soon as it is made."""
        if self.transport.grouped or self.rank == self.schedule.placement[-1]:
            return None  # on NCCL a receive outside the schedule's batches could stall the stream
        buf, works, _ = self._loss_receive()
        return buf, works, self.transport.watch(works)

    def _loss_receive(self) -> tuple[torch.Tensor, list[Any], Any]:
        buf = torch.empty(1, dtype=torch.float64, device=self.device)
        op = tp.Op(self.schedule.placement[-1], buf, send=False, tag=self._mailbox.loss_tag)
        (works,) = self.transport.post([op])
        return buf, works, None

    def _share_loss(self, step: Step, posted: tuple[torch.Tensor, list[Any], Any] | None = None) -> float:
        """The step's mean loss, computed where the last stage lives and sent to every other rank."""
        owner = self.schedule.placement[-1]
        if self.rank == owner:
            assert step.weights is not None
            value = sum(float(step.losses[i]) * w for i, w in enumerate(step.weights))
            buf = torch.tensor([value], dtype=torch.float64, device=self.device)
            tag = self._mailbox.loss_tag
            self.transport.post([tp.Op(r, buf, send=True, tag=tag) for r in range(self.num_ranks) if r != owner])
            self.transport.finish_sends()
        else:
            buf, works, watch = self._loss_receive() if posted is None else posted
            self.transport.wait(works, f"the step's loss from rank {owner}", watch=watch)
            self.transport.synchronize(self.device)
        return float(buf.item())

    def _step_optimizer(self, stage: int) -> None:
        if self.hybrid is not None:
            self.hybrid.before_step(stage)
        self.tied.finish(stage)
        opt = self.optimizers.get(stage)
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)

    def _with_steps(self, actions: tuple[Action, ...], optimizing: bool) -> tuple[Action, ...]:
        if not optimizing:
            return actions
        stepped = {a.stage for a in actions if a.kind is Kind.STEP}
        extra = [Action(s, Kind.STEP) for s in self.local_stages if s not in stepped]
        return tuple(actions) + tuple(extra)

    def release_at_exit(self) -> None:
        """At interpreter exit: let go of the process groups (see ``transport._close_all``)."""
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


def _optimizers(stages: dict[int, _Stage], factory: OptimizerFactory | None) -> dict[int, torch.optim.Optimizer]:
    """One optimizer per stage that has trainable parameters, so each STEP action steps its own stage."""
    if factory is None:
        return {}
    out = {}
    seen: set[int] = set()  # a module tied between two local stages is stepped by the first
    for s, stage in sorted(stages.items()):
        params = stage_parameters(stage.modules, seen)
        if params:
            out[s] = factory(params)
    return out


def _resolve_schedule(
    schedule: str | Schedule, num_ranks: int, microbatches: int | None, virtual_stages: int | None
) -> Schedule:
    """The complete, validated schedule to run, checked against the group before anything is built."""
    from .. import build_schedule

    if isinstance(schedule, str):
        schedule_info(schedule)  # a clear error for unknown names
        m = num_ranks if microbatches is None else microbatches
        return build_schedule(schedule, num_ranks, m, virtual_stages)
    if not isinstance(schedule, Schedule):
        raise TypeError(f"schedule must be a registered name or a stagewise.Schedule, got {type(schedule).__name__}")
    if schedule.num_ranks != num_ranks:
        raise ValueError(
            f"schedule {schedule.name!r} has {schedule.num_ranks} ranks, but the process group has {num_ranks}"
        )
    if microbatches is not None and microbatches != schedule.num_microbatches:
        raise ValueError(
            f"microbatches={microbatches}, but schedule {schedule.name!r} runs {schedule.num_microbatches}"
        )
    if virtual_stages is not None and virtual_stages != schedule.virtual_stages:
        raise ValueError(
            f"virtual_stages={virtual_stages}, but schedule {schedule.name!r} has {schedule.virtual_stages} per rank"
        )
    if schedule.is_complete:
        validate_schedule(schedule)
        return schedule
    return lower(schedule)


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, (tuple, list)):
        moved = [_to(v, device) for v in value]
        if isinstance(value, list):
            return moved
        return type(value)(*moved) if hasattr(value, "_fields") else tuple(moved)
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    return value


def _hybrid(parallel: Any, group: Any) -> Any:
    """The hybrid-parallel parts for ``parallel=`` (a ParallelConfig or Mesh), or None."""
    if parallel is None:
        return None
    if group is not None:
        raise ValueError("pass either group= or parallel=: with parallel= the pipeline runs on the mesh's pp group")
    from .parallel import Hybrid

    return Hybrid(parallel)
