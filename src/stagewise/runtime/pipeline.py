"""``Pipeline``: a model cut into stages over a process group, trained by interpreting a schedule.

Every rank builds the same Pipeline (SPMD). A rank builds only the layers of
its own stages; the Pipeline *is* an ``nn.Module`` holding them under their
names in the original model, so ``parameters()``, ``named_parameters()`` and
``state_dict()`` give this rank's share with the keys a one-process model has.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
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
from .errors import PipelineError
from .interpreter import Interpreter, Step
from .layers import Layers, Partition, build_layer, call_layer, named_layers
from .layers import partition as partition_layers
from .messages import Mailbox
from .microbatch import Dims, merge, split

log = logging.getLogger(__name__)

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


class _Stage:
    """The layers of one stage, applied in order under the calling convention."""

    def __init__(self, modules: list[nn.Module]) -> None:
        self.modules = modules

    def __call__(self, x: Any) -> Any:
        for module in self.modules:
            x = call_layer(module, x)
        return x


class Pipeline(nn.Module):
    """A model pipelined over the ranks of ``group`` by the schedule ``schedule``.

    ``layers``: an ``nn.Sequential``, a list (or dict) of modules, or of
    :class:`~stagewise.Layer` specs built lazily, each seeded with
    ``seed + layer index`` (so :func:`~stagewise.build_model` with the same
    seed is the one-process twin). ``schedule``: a registered name or a
    :class:`~stagewise.Schedule` (e.g. loaded from CSV; its rank count must be
    the group size). ``microbatches`` defaults to the schedule's count, or the
    group size for a name; ``virtual_stages`` to the schedule's default.
    ``partition``: ``"uniform"``, ``"parameters"`` or layer counts per stage.
    ``loss_fn(output, target)`` must return the micro-batch's *mean* loss; each
    micro-batch's loss is weighted by its share of the batch, so a step's
    gradients are those of the mean loss over the whole batch. ``optimizer``:
    an optional factory ``params -> Optimizer``, one per stage, stepped (and
    zeroed) by the schedule's STEP actions, or after the step if it has none.
    ``batch_dim`` / ``target_batch_dim``: where the batch dim of the inputs /
    targets is (see :mod:`stagewise.runtime.microbatch`). ``timeout``: seconds
    any wait may take before every rank raises :class:`PipelineError`.

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
        group: Any = None,
        seed: int = 0,
        device: torch.device | str | None = None,
        optimizer: OptimizerFactory | None = None,
        batch_dim: Dims = 0,
        target_batch_dim: Dims = 0,
        timeout: float = 300.0,
        store: Any = None,
    ) -> None:
        super().__init__()
        tp.require_initialized()
        group = tp.group_or_world(group)
        self.rank = tp.group_rank(group)
        self.num_ranks = tp.group_size(group)
        self.schedule = _resolve_schedule(schedule, self.num_ranks, microbatches, virtual_stages)
        self.loss_fn = loss_fn
        self.batch_dim = batch_dim
        self.target_batch_dim = target_batch_dim
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if tp.backend_of(group) == "nccl" else "cpu"
        self.device = torch.device(device)

        stages = self._build_stages(named_layers(layers), partition, seed)
        self.optimizers = _optimizers(stages, optimizer)
        self._train_actions = self._with_steps(self.schedule.ranks[self.rank], optimizer is not None)
        self._eval_actions = tuple(
            a for a in self.schedule.ranks[self.rank] if a.kind in (Kind.F, Kind.SEND_F, Kind.RECV_F)
        )
        name, pipeline_id = tp.next_pipeline_id(group)
        self.transport = tp.Transport(
            group, name=name, pipeline_id=pipeline_id, timeout=timeout, store=store, side=tp.side_group(group)
        )
        self.transport.warm_up()
        self._mailbox = Mailbox(self.transport, self.schedule.placement, self.schedule.num_microbatches, self.device)
        self._sync_hooks: list[Callable[[int], None]] = []
        self._interpreter = Interpreter(
            rank=self.rank,
            placement=self.schedule.placement,
            stages=dict(stages),
            loss_fn=loss_fn,
            transport=self.transport,
            mailbox=self._mailbox,
            step_stage=self._step_optimizer,
            sync_hooks=self._sync_hooks,
        )
        self._last_step: Step | None = None
        self._step_started = 0.0
        self._clock_offset = time.time() - time.perf_counter()

    def _build_stages(self, named: list[tuple[str, Any]], how: Partition, seed: int) -> dict[int, _Stage]:
        """Build this rank's layers only, registered under their names in the original model."""
        self.layer_ranges = partition_layers(named, self.schedule.num_stages, how)
        self.local_stages = self.schedule.stages_of(self.rank)
        stages: dict[int, _Stage] = {}
        for s in self.local_stages:
            modules = []
            for k in self.layer_ranges[s]:
                name, layer = named[k]
                if hasattr(self, name) and name not in self._modules:
                    raise ValueError(f"layer name {name!r} clashes with a Pipeline attribute; rename the layer")
                module = build_layer(layer, k, seed).to(self.device)
                self.add_module(name, module)
                modules.append(module)
            stages[s] = _Stage(modules)
        log.info(
            "stagewise: rank %d holds stages %s (layers %s) of schedule %r",
            self.rank,
            list(self.local_stages),
            [f"{r.start}..{r.stop - 1}" for r in (self.layer_ranges[s] for s in self.local_stages)],
            self.schedule.name,
        )
        return stages

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

    def register_sync_hook(self, hook: Callable[[int], None]) -> None:
        """Call ``hook(stage)`` at each SYNC action, once the stage's gradients are final."""
        self._sync_hooks.append(hook)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("a Pipeline is not called directly: use train_step(inputs, targets) or eval_step(inputs)")

    # ---- steps -------------------------------------------------------------
    def _guarded(self, body: Callable[[], Any]) -> Any:
        if self.transport.failure is not None:
            raise PipelineError(f"the pipeline failed earlier and cannot run again: {self.transport.failure}")
        try:
            return body()
        except PipelineError:
            raise
        except BaseException as err:
            self.transport.fail(f"rank {self.rank}: {type(err).__name__}: {err}")
            raise

    def _train(self, inputs: Any, targets: Any) -> float:
        step = self._prepare("train", inputs, targets)
        self._run(self._train_actions, step)
        return self._share_loss(step)

    def _eval(self, inputs: Any, merge_outputs: bool) -> Any:
        step = self._prepare("eval", inputs, None)
        with torch.no_grad():
            self._run(self._eval_actions, step)
        if self.schedule.placement[-1] != self.rank:
            return None
        outputs = [step.outputs[i] for i in range(self.schedule.num_microbatches)]
        return merge(outputs) if merge_outputs else outputs

    def _run(self, actions: tuple[Action, ...], step: Step) -> None:
        self._last_step = step
        self._step_started = time.perf_counter()
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

    def _share_loss(self, step: Step) -> float:
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
            buf = torch.empty(1, dtype=torch.float64, device=self.device)
            (works,) = self.transport.post([tp.Op(owner, buf, send=False, tag=self._mailbox.loss_tag)])
            self.transport.wait(works, f"the step's loss from rank {owner}")
            self.transport.synchronize(self.device)
        return float(buf.item())

    def _step_optimizer(self, stage: int) -> None:
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

    def __del__(self) -> None:
        transport = self.__dict__.get("transport")
        if transport is not None:
            transport.close()


def _optimizers(stages: dict[int, _Stage], factory: OptimizerFactory | None) -> dict[int, torch.optim.Optimizer]:
    """One optimizer per stage that has trainable parameters, so each STEP action steps its own stage."""
    if factory is None:
        return {}
    out = {}
    for s, stage in stages.items():
        params = [p for m in stage.modules for p in m.parameters() if p.requires_grad]
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
