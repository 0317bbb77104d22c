"""Streaming training for asynchronous schedules: mini-batches in, one loss per mini-batch out, on every rank.

An asynchronous schedule is a *window* of N mini-batches (its version table
says which weights each action uses). :func:`train_stream` takes the stream N
mini-batches at a time and runs each window as one validated schedule; the
window's losses come out once it ends. A window boundary drains the
pipeline: the next window starts with empty stages and versions counted
afresh from the weights (and optimizer state) the last one left, so the
stream is trained exactly by the rule of :mod:`stagewise.asynchronous.versions` applied
window by window. Larger windows amortise the drain (bubble
(p - 1)/(N*m + p - 1)). A last, shorter window runs the same schedule over
the mini-batches left.

What is refused, before any rank communicates (:func:`check_async`): no
optimizer factory (each stage steps at its own STEPs), ``recompute=`` (a
checkpointed segment would recompute on the live weights, not the stashed
version), tied modules (their copies on two stages would step at different
times), ``parallel=`` with tp or sharding (checked in :mod:`..context`), and
an optimizer without a prediction rule for ``xpipe``.

Data parallelism (``parallel=ParallelConfig(pp=..., dp=...)``): each replica
streams its own share of every mini-batch (:meth:`Pipeline.local_batch`); at
each stage's SYNC the mini-batch's summed gradient becomes ``.grad`` and the
replicas average it (the data-parallel averager, started at SYNC, waited for
at STEP), so every replica applies the same update to the same version; the
losses yielded are averaged over the replicas.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ...asynchronous import VersionTable
from ...ir import Schedule
from ...schedules import window_of
from ...validate import async_table
from ..engine.interpreter import Step
from ..engine.microbatch import split
from ..engine.step import to_device
from .interpreter import AsyncInterpreter
from .predict import check_predictable
from .versions import StageVersions, VersionedStage

if TYPE_CHECKING:
    from ..frontends.stages import BuiltStages
    from ..options import RunOptions
    from ..pipeline import Pipeline


def is_async_request(schedule: object) -> bool:
    """Whether ``schedule`` (a registered name or a Schedule) is asynchronous."""
    from ...schedules import schedule_info

    if isinstance(schedule, str):
        return not schedule_info(schedule).synchronous
    return isinstance(schedule, Schedule) and async_table(schedule) is not None


def check_async(schedule: Schedule, options: RunOptions, parts: BuiltStages) -> None:
    """Refuse what asynchronous schedules do not support, naming the option (pure in the options: every rank
    raises alike)."""
    table = async_table(schedule)
    if table is None:
        return
    name = schedule.name
    if options.optimizer is None:
        raise ValueError(
            f"asynchronous schedule {name!r} needs Pipeline(optimizer=...), a factory params -> Optimizer: "
            "each stage applies its own optimizer at its STEP actions"
        )
    if options.recompute is not None:
        raise ValueError(
            f"recompute= is not supported with asynchronous schedule {name!r}: a checkpointed segment would "
            "recompute on the live weights, not the weight version its forward used"
        )
    if parts.tied is not None and parts.tied.first:
        keys = ", ".join(sorted(parts.tied.first))
        raise ValueError(
            f"tied modules ({keys}) are not supported with asynchronous schedule {name!r}: their copies on "
            "different stages would step at different times and hold different versions"
        )
    if table.policy == "predict":
        probe = options.optimizer([nn.Parameter(torch.zeros(1))])
        check_predictable(probe)


class AsyncTrainer:
    """This rank's windows: the version-aware interpreter, the snapshot stores, one lowered schedule per size."""

    def __init__(self, pipe: Pipeline) -> None:
        self.pipe = pipe
        runner = pipe._runner
        table = async_table(pipe.schedule)
        assert table is not None
        self.table: VersionTable = table
        self.size = table.minibatches
        stages = {s: VersionedStage(st) for s, st in runner.stages.items()}
        versions = {s: StageVersions(stages[s], pipe.optimizers.get(s)) for s in stages}
        self.interpreter = AsyncInterpreter(runner.interpreter, stages, versions)
        self._windows: dict[int, tuple[VersionTable, tuple[Any, ...]]] = {}

    def window(self, n: int) -> tuple[VersionTable, tuple[Any, ...]]:
        """The version table and this rank's actions of the window of ``n`` mini-batches."""
        if n not in self._windows:
            schedule = self.pipe.schedule
            if n != self.size:
                from ...passes import lower
                from ...validate import validate_versions

                schedule = lower(window_of(schedule, n))
                validate_versions(schedule)
            table = async_table(schedule)
            assert table is not None
            self._windows[n] = (table, tuple(schedule.ranks[self.pipe.rank]))
        return self._windows[n]

    def run(self, batches: list[tuple[Any, Any]]) -> list[float]:
        """Train on ``batches`` (at most a window's worth) as one window; their losses, on every rank."""
        runner = self.pipe._runner
        table, actions = self.window(len(batches))

        def body() -> list[float]:  # guarded: a failure here (bad data too) is posted, so no rank waits for it
            step = self._prepare(batches, table.microbatches)
            self.interpreter.start_window(table)
            runner.last_step, runner.running = step, actions
            runner.step_started = time.perf_counter()
            self.pipe.tied.start_step()
            self.interpreter.run(actions, step)
            self.pipe.transport.finish_sends()
            self.pipe.tied.finish()
            return self._share_losses(step, len(batches), table.microbatches)

        return runner.guarded(body)  # type: ignore[no-any-return]

    def _prepare(self, batches: list[tuple[Any, Any]], m: int) -> Step:
        pipe = self.pipe
        placement = pipe.schedule.placement
        first, last = placement[0] == pipe.rank, placement[-1] == pipe.rank
        step = Step("train", [] if first else None, [] if last else None, [] if last else None)
        for t, item in enumerate(batches):
            if not (isinstance(item, (tuple, list)) and len(item) == 2):
                raise ValueError(
                    f"train_stream: mini-batch {t} of the window must be an (inputs, targets) pair, "
                    f"got {type(item).__name__}"
                )
            inputs, targets = item
            if first:
                if inputs is None:
                    raise ValueError(f"rank {pipe.rank} holds stage 0, so mini-batch {t} needs its inputs")
                chunks, _ = split(inputs, m, pipe.batch_dim, "inputs")
                step.inputs += [to_device(c, pipe.device) for c in chunks]  # type: ignore[operator]
            if last:
                if targets is None:
                    raise ValueError(f"rank {pipe.rank} holds the last stage, so mini-batch {t} needs its targets")
                if pipe.loss_fn is None:
                    raise ValueError("train_stream needs a loss: build the Pipeline with loss_fn=...")
                chunks, sizes = split(targets, m, pipe.target_batch_dim, "targets")
                step.targets += [to_device(c, pipe.device) for c in chunks]  # type: ignore[operator]
                step.weights += [k / sum(sizes) for k in sizes]  # type: ignore[operator]
        return step

    def _share_losses(self, step: Step, n: int, m: int) -> list[float]:
        """Each mini-batch's loss (its micro-batches' losses weighted by their shares), from the last stage's rank."""
        pipe = self.pipe
        owner = pipe.schedule.placement[-1]
        buf = torch.zeros(n, dtype=torch.float64, device=pipe.device)
        if pipe.rank == owner:
            assert step.weights is not None
            for i, w in enumerate(step.weights):
                buf[i // m] += float(step.losses[i]) * w
        if pipe.num_ranks > 1:
            pipe.transport.broadcast(buf, owner, f"the window's losses from rank {owner}")
        if pipe.hybrid is not None:  # data parallel: each mini-batch's loss, averaged over the replicas
            pipe.hybrid.before_step()
            pipe.hybrid.mesh.all_reduce(buf, ("dp", "sharding"))
            buf /= pipe.hybrid.config.replicas
        return [float(x) for x in buf.tolist()]


def train_stream(pipe: Pipeline, batches: Iterable[tuple[Any, Any]], steps: int | None) -> Iterator[float]:
    """See :meth:`stagewise.Pipeline.train_stream` (checks now, trains as the iterator is consumed)."""
    if not is_async_request(pipe.schedule):
        raise ValueError(
            f"train_stream runs asynchronous schedules (pipedream, pipedream-2bw, xpipe); schedule "
            f"{pipe.schedule.name!r} is synchronous: use train_step(inputs, targets) and step the optimizer"
        )
    if steps is not None and steps < 0:
        raise ValueError(f"train_stream: steps must be >= 0 or None, got {steps}")
    trainer = pipe.__dict__.get("_async_trainer")
    if trainer is None:
        trainer = AsyncTrainer(pipe)
        pipe.__dict__["_async_trainer"] = trainer
    return _stream(trainer, iter(batches), steps)


def _stream(trainer: AsyncTrainer, stream: Iterator[tuple[Any, Any]], steps: int | None) -> Iterator[float]:
    taken = 0
    while steps is None or taken < steps:
        want = trainer.size if steps is None else min(trainer.size, steps - taken)
        window = []
        for item in stream:
            window.append(item)
            if len(window) == want:
                break
        if not window:
            return
        yield from trainer.run(window)
        taken += len(window)
        if len(window) < want:
            return
