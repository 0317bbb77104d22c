"""The run value: one run of a rank's action list (a train step, an asynchronous window, an eval), as every part
that takes part in it sees it.

The runner makes one :class:`Run` per run and hands it to every part: each :class:`~.runner.StepPart`'s
``around`` and ``after``, each handler of the interpreter's table, each :class:`~.hooks.StagePart` at SYNC and
STEP. What is per run lives here and nowhere else: the action running (``current``: dropout's seeds, the
activation meter and BatchNorm read it here), the values between stages (inbox, outbox, posted receives and
sends), what each forward saved for its backward, and whether the run's gradients only accumulate
(``accumulate``: a gradient merge's flag, set once by the merge's part). Its :class:`RunRecord` is what the run
leaves behind: the micro-batches in, the losses or outputs out, the timeline (:mod:`.timings`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ...ir import Action, Message
from .timings import StepTimings

if TYPE_CHECKING:
    from .backward import WeightWork
    from .messages import Pending


@dataclass
class RunRecord(StepTimings):
    """What a run reads and leaves: micro-batches in, losses or outputs out, and its timeline (:mod:`.timings`)."""

    mode: str  # "train" or "eval"
    inputs: list[Any] | None  # micro-batches, for the rank holding stage 0
    targets: list[Any] | None  # for the rank holding the last stage
    weights: list[Any] | None  # each micro-batch's share of the batch (a float, or a 0-dim tensor on the device)
    losses: dict[int, torch.Tensor] = field(default_factory=dict)
    outputs: dict[int, Any] = field(default_factory=dict)
    #: counts of ``loss_weights`` kept on the device, checked with the losses (``.batches.DeferredCounts``), or None
    counts: Any = None


@dataclass
class Saved:
    """What a stage's backward for one micro-batch needs from its forward."""

    inputs: list[torch.Tensor]  # the differentiable input leaves (their gradients go back)
    roots: list[torch.Tensor]  # floating outputs, or the weighted loss on the last stage
    weight_work: WeightWork | None = None


class Exchange(Protocol):
    """How a handler takes a value another stage made and hands one on (the interpreter's communication)."""

    def take(self, run: Run, msg: Message) -> Any: ...
    def deliver(self, run: Run, msg: Message, value: Any) -> None: ...
    def ready(self, run: Run) -> None: ...


@dataclass(eq=False)
class Run:
    """One run of this rank's action list: what the runner, the step parts and the handlers share."""

    mode: str  # "train" or "eval"
    record: RunRecord  # the micro-batches, their losses or outputs, the timeline
    minibatches: int = 1  # mini-batches in the run (an asynchronous window holds several)
    per_minibatch: int = 1  # micro-batches per mini-batch
    first: int = 0  # mini-batches trained before it: where the run starts in the stream
    losses: list[float] = field(default_factory=list)  # train, once shared: each mini-batch's mean loss
    accumulate: bool = False  # its gradients only accumulate (a gradient merge's step): no reduction, no STEP
    table: Any = None  # an asynchronous window's version table (which weights each action uses), else None
    kept_inputs: dict[tuple[int, int], Any] = field(default_factory=dict)  # inputs kept for a recomputing B
    late: list[Any] = field(default_factory=list)  # what raised after a stage stepped (.hooks.AfterStep): at the end
    # ---- the interpreter's, for this run --------------------------------------------------------------
    current: Action | None = None  # the action running (or the last one run)
    inbox: dict[Message, Any] = field(default_factory=dict)  # values from a stage on this rank
    outbox: dict[Message, Any] = field(default_factory=dict)  # values made here, waiting for their SEND
    pending: dict[Message, Pending] = field(default_factory=dict)  # posted receives
    sent: dict[Message, list[Any]] = field(default_factory=dict)  # works of posted forward sends, till used
    saved: dict[tuple[int, int], Saved] = field(default_factory=dict)  # (stage, micro-batch) -> its forward's
    order: list[Message] = field(default_factory=list)  # messages from other ranks, in the order consumed
    consumed: int = 0  # how many of them were taken
    sends: list[tuple[Message, Any]] = field(default_factory=list)  # the batch being collected
    recvs: list[Message] = field(default_factory=list)
    started: float = 0.0  # perf_counter when the running compute action's input was there
    cpu_started: float = 0.0  # the CPU clock then
    cpu_clock: Callable[[], float] = time.thread_time  # the compute's CPU clock (:mod:`.timings`)
    exchange: Exchange | None = None  # set by the interpreter while it runs

    def take(self, msg: Message) -> Any:
        """The value ``msg`` (from a stage on this rank, or its posted receive, waited for)."""
        assert self.exchange is not None
        return self.exchange.take(self, msg)

    def deliver(self, msg: Message, value: Any) -> None:
        """Hand ``value`` on as ``msg``: to a stage on this rank, or to the outbox for its SEND."""
        assert self.exchange is not None
        self.exchange.deliver(self, msg, value)

    def ready(self) -> None:
        """The running compute action has its input: its time starts now (:mod:`.timings`)."""
        assert self.exchange is not None
        self.exchange.ready(self)
