"""Running steps: a train or eval step of one rank, from the mini-batch to the loss every rank returns.

The Runner owns what a step touches (the interpreter and its action lists,
the stages, tied sums, the hybrid axes' reductions, the memory meter) and
what a step leaves behind (its events, its losses); the Pipeline facade only
delegates. A failure on this rank is posted to the error board with this
rank's place in its action list (:mod:`.forensics`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ...ir import Action, Schedule
from ..comm.transport.protocol import Transport
from ..errors import PipelineError
from ..features.batchnorm import BatchNorms
from ..features.finite import FiniteCheck
from ..features.memory import ActivationMeter
from .forensics import position
from .interpreter import Interpreter, Step
from .microbatch import Dims, merge
from .stage import Stage
from .step import prepare_step


@dataclass
class Runner:
    """Executes this rank's train and eval action lists and shares the step's loss."""

    rank: int
    schedule: Schedule
    device: torch.device
    transport: Transport
    interpreter: Interpreter
    stages: dict[int, Stage]
    train_actions: tuple[Action, ...]
    eval_actions: tuple[Action, ...]
    batch_dims: tuple[Dims, Dims]
    has_loss: bool
    tied: Any  # TiedSync: tied gradients summed over their owners
    hybrid: Any = None  # Hybrid: the other axes' reductions, or None
    meter: ActivationMeter | None = None
    norms: BatchNorms | None = None  # BatchNorm running statistics under the batchnorm= policy
    loss_weights: Callable[[Any], Any] | None = None  # a micro-batch's weight: its count over the batch's
    last_step: Step | None = None
    running: tuple[Action, ...] = ()
    step_started: float = 0.0
    losses: dict[str, Any] = field(default_factory=dict)
    finite: FiniteCheck | None = None  # the step-end check of non-finite values (see .finite), when set
    checked: bool = False  # whether this train step's check has run

    def guarded(self, body: Callable[[], Any]) -> Any:
        """Run ``body``; any failure is posted to the board (or annotated) with where this rank stood."""
        if self.transport.failure is not None:
            raise PipelineError(f"the pipeline failed earlier and cannot run again: {self.transport.failure}")
        try:
            return body()
        except PipelineError as err:
            raise PipelineError(f"{err}\n{self.position()}") from err
        except BaseException as err:
            self.transport.fail(f"{self.transport.me}: {type(err).__name__}: {err}\n{self.position()}")
            raise

    def position(self) -> str:
        """Where this rank stood in the action list it was running (see :mod:`.forensics`)."""
        step = self.last_step
        done = step.events[-1][0] if step is not None and step.events else None
        current = getattr(self.interpreter, "current", None)
        return position(self.rank, self.running, current, done, self.transport.waiting)

    def _prepare(self, mode: str, inputs: Any, targets: Any) -> Step:
        return prepare_step(
            mode,
            inputs,
            targets,
            rank=self.rank,
            placement=self.schedule.placement,
            num_microbatches=self.schedule.num_microbatches,
            batch_dims=self.batch_dims,
            device=self.device,
            has_loss=self.has_loss,
            loss_weights=self.loss_weights,
        )

    def train(self, inputs: Any, targets: Any) -> float:
        step = self._prepare("train", inputs, targets)
        self.tied.start_step()
        self.checked = False
        for st in self.stages.values():
            st.aux_totals = {}
        if self.meter is None:
            self._run(self.train_actions, step)
        else:
            self.meter.reset()
            with self.meter.hooks():
                self._run(self.train_actions, step)
        self.tied.finish()
        self.check_finite()  # when the list had no STEP (no optimizer factory), the check runs here
        loss = self._share_loss(step)
        aux_local: dict[str, float] = {}
        for st in self.stages.values():
            for n, v in st.aux_totals.items():
                aux_local[n] = aux_local.get(n, 0.0) + v
        if self.hybrid is not None:  # wait for the gradient reductions; the mean over the replicas
            last = self.rank == self.schedule.placement[-1]
            loss = self.hybrid.after_train(loss, targets if last else None, self.batch_dims[1])
        self.losses = {"loss": loss, "aux_local": aux_local}
        return loss

    def eval(self, inputs: Any, merge_outputs: bool) -> Any:
        step = self._prepare("eval", inputs, None)
        with torch.no_grad():
            self._run(self.eval_actions, step)
        if self.hybrid is not None:
            self.hybrid.after_eval()
        if self.schedule.placement[-1] != self.rank:
            return None
        outputs = [step.outputs[i] for i in range(self.schedule.num_microbatches)]
        return merge(outputs) if merge_outputs else outputs

    def check_finite(self) -> None:
        """The step-end check of non-finite values (:mod:`.finite`), once per train step: at its first STEP action
        (the schedule puts them at the end of each rank's list when checking) or after the list.

        Every gradient must be final first: tied sums and the hybrid axes' reductions are waited for.
        """
        if self.finite is None or self.checked or self.last_step is None or self.last_step.mode != "train":
            return
        self.checked = True
        self.tied.finish()
        if self.hybrid is not None:
            self.hybrid.before_step()
        last = self.schedule.placement[-1] == self.rank
        step = self.last_step
        self.finite(step.losses if last else {}, self.schedule.num_stages - 1 if last else None)

    def on_sync(self, stage: int) -> None:
        """(A stage part: nothing at SYNC.)"""

    def before_step(self, stage: int) -> None:
        """A stage part: the first STEP of a train step runs the check of non-finite values."""
        self.check_finite()

    def _run(self, actions: tuple[Action, ...], step: Step) -> None:
        self.last_step, self.running = step, actions
        reset = getattr(self.transport, "reset_waiting", None)  # "waiting for" must be this step's
        if reset is not None:
            reset()
        self.step_started = time.perf_counter()
        if self.norms is None:
            self.interpreter.run(actions, step)
        else:
            with self.norms.step(step.mode):
                self.interpreter.run(actions, step)
        self.transport.finish_sends()

    def _share_loss(self, step: Step) -> float:
        """The step's mean loss: computed where the last stage lives, broadcast over the pipeline group.

        A collective every rank issues once per train step, after its action list
        (the one exchange of a step outside the schedule's point-to-point).
        """
        owner = self.schedule.placement[-1]
        value = 0.0
        if self.rank == owner:
            assert step.weights is not None
            value = sum(float(step.losses[i]) * w for i, w in enumerate(step.weights))
        buf = torch.tensor([value], dtype=torch.float64, device=self.device)
        if self.schedule.num_ranks > 1:
            self.transport.broadcast(buf, owner, f"the step's loss from rank {owner}")
        return float(buf.item())
