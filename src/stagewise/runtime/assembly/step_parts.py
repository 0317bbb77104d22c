"""What the parts built outside ``features/`` do around each step: the runner's :class:`StepPart` for each.

The tied sums (:class:`~stagewise.runtime.frontends.tied.TiedSync`), the hybrid axes
(:class:`~stagewise.runtime.hybrid.hybrid.Hybrid`) and the activation meter
(:class:`~stagewise.runtime.features.memory.ActivationMeter`) keep their own jobs; these adapters say, in one
place, when in a step each is asked to do them. The features written as step parts (the check of non-finite
values, BatchNorm, the aux totals) are their own adapters; :func:`reporting_part` builds what the pipeline
reports (:mod:`..reporting`). :func:`.assemble.assemble` registers them all.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from ..comm import groups
from ..engine.microbatch import Dims, batch_size
from ..engine.run import Run
from ..hybrid.replica_inputs import refuse_same_inputs
from ..reporting.config import metrics_config, progress_every
from ..reporting.reporter import Reporter

if TYPE_CHECKING:
    from torch import nn

    from ..features.finite import FinitePart
    from ..features.memory import ActivationMeter
    from ..frontends.parts import PipelineContext
    from ..frontends.tied import TiedSync
    from ..hybrid.hybrid import Hybrid
    from ..options import Options


class TiedPart:
    """A train step starts the tied sums afresh (each starts at the SYNC of its last local stage); after it, every
    one is waited for and written back (none in a gradient merge's step that only accumulates)."""

    def __init__(self, tied: TiedSync) -> None:
        self.tied = tied

    @contextmanager
    def around(self, run: Run) -> Iterator[None]:
        if run.mode == "train":
            self.tied.start_step()
        yield

    def after(self, run: Run) -> None:
        if run.mode == "train" and not run.accumulate:
            self.tied.finish()


class HybridPart:
    """After a train step, the replicas' reductions are waited for and each mini-batch's loss is their mean (a
    check that the replicas trained on equal batches comes with it); after an eval, sharded stages let go of
    their gathered parameters."""

    def __init__(self, hybrid: Hybrid, target_dims: Dims, device: torch.device, *, weighted: bool, wait: Any) -> None:
        self.hybrid = hybrid
        self.target_dims = target_dims
        self.weighted = weighted  # the losses were weighted over every replica already (loss_weights=)
        self.device = device
        self.wait = wait  # within the pipeline's deadline, on its board
        self.inputs_checked = False  # the first train step refuses replicas all given the same batch

    @contextmanager
    def around(self, run: Run) -> Iterator[None]:
        if run.mode == "train" and not self.inputs_checked:
            self.inputs_checked = True
            refuse_same_inputs(self.hybrid, run.record.inputs, run.record.targets, self.wait)
        yield

    def after(self, run: Run) -> None:
        if run.mode == "train":
            run.losses = self.hybrid.after_train(run.losses, self._samples(run), exact=self.weighted)
        else:
            self.hybrid.after_eval()

    def over_replicas(self, totals: torch.Tensor) -> torch.Tensor:
        """Each mini-batch's counted items over every data-parallel replica, divided by the replica count: the
        weights then make the replicas' averaged gradient the global batch's token mean, however unevenly the
        counted items fall over the replicas. (On the device, unread.)"""
        t = totals.to(self.device, torch.float64, non_blocking=True, copy=True)
        self.hybrid.mesh.all_reduce(t, ("dp", "sharding"), wait=self.wait, what="the counted items")
        return t / self.hybrid.config.replicas

    def _samples(self, run: Run) -> float | None:
        """The rows this rank's mini-batches trained on (where the last stage lives), for the replicas' check."""
        targets = run.record.targets
        if targets is None:
            return None
        return float(sum(batch_size(t, self.target_dims, "targets") for t in targets))


class MeterPart:
    """A train step runs under the meter's saved-tensor hooks, its peak and per-action bytes counted afresh; the
    meter reads the action running from the run value."""

    def __init__(self, meter: ActivationMeter) -> None:
        self.meter = meter

    @contextmanager
    def around(self, run: Run) -> Iterator[Any]:
        if run.mode != "train":
            yield
            return
        self.meter.run = run
        try:
            with self.meter.hooks():
                self.meter.reset()
                yield
        finally:
            self.meter.run = None

    def after(self, run: Run) -> None:
        """(What it measured stays on the meter: ``Pipeline.memory_report``.)"""


def reporting_part(
    root: nn.Module,
    ctx: PipelineContext,
    options: Options,
    optimizers: dict[int, torch.optim.Optimizer],
    finite: FinitePart | None,
    meter: ActivationMeter | None,
) -> Reporter:
    """What the pipeline reports (:mod:`..reporting`): metrics=, the progress line, the events, each mode's last run."""
    return Reporter(
        metrics_config(options.metrics),
        progress=progress_every(options.progress),
        process_rank=groups.global_rank(),
        pp_rank=ctx.rank,
        dims=(options.batch_dim, options.target_batch_dim),
        optimizers=lambda: [optimizers[s] for s in sorted(optimizers)],
        params=root.parameters,
        skipped=lambda: 0 if finite is None else finite.skipped,
        activation_peak=lambda: None if meter is None else meter.peak,
    )
