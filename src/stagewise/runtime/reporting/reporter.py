"""The reporting part of each step: per-step metrics, rank 0's progress line, the events other parts name.

Registered by the assembly as a :class:`~..engine.runner.StepPart`, last (after the replicas' mean loss and the
check of non-finite values). After each train step it builds the step's record from what this rank holds
(:mod:`.record`: no collective) and hands it to the sinks (:mod:`.sinks`) every ``every`` steps, and, on
process rank 0, logs a line through :mod:`.progress`'s logger at INFO::

    step 12  loss 3.4512  lr 3.00e-03  412 samples/s  26,368 tokens/s  step 77.6 ms  bubble 41.2%

It also keeps each mode's last run apart (``Pipeline.timeline()`` describes the last *train* step even after
an ``eval_step``), and takes :meth:`event` (``relayout``, ``machine_lost``, ``straggler``, ``replan``...) and
:meth:`grad_norm` (from :func:`~..features.clip.clip_pipeline_grads`) from other parts.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ..engine.microbatch import Dims
from ..engine.run import Run
from .config import MetricsConfig
from .progress import progress_line, progress_log
from .record import batch_counts, learning_rate, parameter_bytes, step_times
from .sinks import Sink, open_sinks

events_log = logging.getLogger(__name__)


class Reporter:
    """What a pipeline reports: its metrics sinks (none without ``metrics=``), its progress line, its events."""

    def __init__(
        self,
        config: MetricsConfig | None,
        *,
        progress: int,
        process_rank: int,
        pp_rank: int,
        dims: tuple[Dims, Dims],
        optimizers: Callable[[], Iterable[torch.optim.Optimizer]],
        params: Callable[[], Iterable[torch.Tensor]],
        skipped: Callable[[], int],
        activation_peak: Callable[[], int | None],
    ) -> None:
        self.config, self.progress, self.process_rank, self.dims = config, progress, process_rank, dims
        self.own_optimizers, self.params, self.skipped, self.activation_peak = (
            optimizers,
            params,
            skipped,
            activation_peak,
        )
        self.watched: list[torch.optim.Optimizer] = []
        self.sinks: list[Sink] = (
            [] if config is None else open_sinks(config.path, process_rank, pp_rank, config.tensorboard)
        )
        self._finalizer = weakref.finalize(self, _close_all, self.sinks)  # (also at interpreter exit)
        self.runs: dict[str, tuple[list[Any], float]] = {}  # mode -> its last run's events, when it started
        self.steps = 0  # train steps finished (mini-batches)
        self.last: dict[str, float] = {}  # the last record's values
        self._norm: float | None = None  # a gradient norm clipped inside the running step
        self._running = False
        self._started = 0.0
        self._lr: float | None = None  # the learning rate the running step trains with
        self._param_bytes: float | None = None

    # ---- what other parts call ----------------------------------------------------------------
    def watch(self, optimizer: torch.optim.Optimizer) -> None:
        """Report ``optimizer``'s learning rate (a user's own optimizer; ``optimizer=``'s are reported already)."""
        if optimizer not in self.watched:
            self.watched.append(optimizer)

    def event(self, name: str, step: int | None = None, **fields: Any) -> None:
        """Record that ``name`` happened (``relayout``, ``machine_lost``, ``machine_back``, ``straggler``,
        ``replan``...) at ``step`` (default: the train steps finished), with ``fields``: one JSON line, a
        TensorBoard count ``events/NAME`` and text, and a line on process rank 0's log (this module's logger, INFO)."""
        at = self.steps if step is None else int(step)
        record = {"event": name, "time": time.time(), **fields}
        for sink in self.sinks:
            sink.event(at, record)
        if self.process_rank == 0:
            said = " ".join(f"{k}={v}" for k, v in fields.items())
            events_log.info("step %d: %s%s", at, name, f" {said}" if said else "")

    def log(self, step: int | None = None, **values: float) -> None:
        """Write the script's own scalars (``val_loss=...``) beside the step's, at ``step`` (default: the train
        steps finished): a JSON line and a TensorBoard scalar each."""
        for sink in self.sinks:
            sink.scalars(self.steps if step is None else int(step), {k: float(v) for k, v in values.items()})

    def grad_norm(self, norm: float) -> None:
        """The gradient norm a clip computed: in the running step's record, or, clipped between steps (after
        ``train_step`` returned), recorded at the step just finished."""
        if self._running:
            self._norm = norm
        else:
            self.last["grad_norm"] = norm
            for sink in self.sinks:
                sink.scalars(self.steps, {"grad_norm": norm})

    def last_run(self, mode: str) -> tuple[list[Any] | None, float]:
        """The last run of ``mode`` (``"train"`` or ``"eval"``): its events ``(action, start, end)`` (None before
        one) and when it started (``perf_counter`` seconds)."""
        if mode not in ("train", "eval"):
            raise ValueError(f"mode must be 'train' or 'eval', got {mode!r}")
        return self.runs.get(mode, (None, 0.0))

    def close(self) -> None:
        """Flush and close the files (also done when the pipeline is collected and at exit)."""
        self._finalizer()

    # ---- the StepPart -----------------------------------------------------------------------------
    @contextmanager
    def around(self, run: Run) -> Iterator[None]:
        self._running = run.mode == "train"
        self._norm = None
        self._started = time.perf_counter()
        self._lr = learning_rate([*self.own_optimizers(), *self.watched])  # the step's: lr_scheduler= steps at its end
        yield

    def after(self, run: Run) -> None:
        ended = time.perf_counter()
        self.runs[run.mode] = (run.record.events, self._started)  # (the events only: no tensor kept alive)
        if run.mode != "train":
            return
        self._running = False
        self.steps = run.first + run.minibatches
        if not self.sinks and not (
            self.progress and self.process_rank == 0 and progress_log.isEnabledFor(logging.INFO)
        ):  # nothing writes the record: only what costs nothing (clip='s norm, as clip_grad_norm_ returns it)
            self.last = {"loss": run.losses[-1] if run.losses else float("nan")}
            if self._norm is not None:
                self.last["grad_norm"] = self._norm
            return
        values = self._values(run, ended - self._started)
        self.last = values
        for i, loss in enumerate(run.losses[:-1]):  # an asynchronous window: each mini-batch's loss at its step
            self._write(run.first + i + 1, {"loss": loss})
        self._write(self.steps, values)
        if self.progress and self.process_rank == 0 and self.steps % self.progress == 0:
            progress_log.info("%s", progress_line(self.steps, values))

    def _write(self, step: int, values: dict[str, float]) -> None:
        if self.config is not None and step % self.config.every == 0:
            for sink in self.sinks:
                sink.scalars(step, values)

    def _values(self, run: Run, wall: float) -> dict[str, float]:
        step = run.record
        values: dict[str, float] = {"loss": run.losses[-1] if run.losses else float("nan")}
        if self._lr is not None:
            values["lr"] = self._lr
        counts = batch_counts(step.inputs, step.targets, self.dims)
        for what, n in counts.items():
            values[f"throughput/{what}_per_s"] = n / wall if wall > 0 else 0.0
        values.update(step_times(step.events, wall))
        if self._param_bytes is None:  # (counted once: a pipeline's parameters keep their sizes)
            self._param_bytes = float(parameter_bytes(self.params()))
        values["memory/parameters"] = self._param_bytes
        peak = self.activation_peak()
        if peak is not None:
            values["memory/activations_peak"] = float(peak)
        if self._norm is not None:
            values["grad_norm"] = self._norm
        values["skipped_steps"] = float(self.skipped())
        return values


def _close_all(sinks: list[Sink]) -> None:
    for sink in sinks:
        sink.close()
