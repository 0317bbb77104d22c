"""Running steps: the one step protocol, from the mini-batches to the losses every rank returns.

Every train step goes through :meth:`Runner.train`: a synchronous schedule's step (one mini-batch), an
asynchronous schedule's window (several mini-batches, each stage stepping at its own STEPs) and, through
those, every HetPipe wave. It owns the whole step: the tied sums, the aux totals, the memory meter, the
BatchNorm policy, the transport's waits, the interpreter's run and its finishing sends, the check of
non-finite values, the shared losses and the hybrid axes' reductions. The Pipeline facade only delegates.
A failure on this rank is posted to the error board with this rank's place in its action list
(:mod:`.forensics`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from ...ir import Action, Schedule
from ..asynchronous.windows import Windows
from ..comm.transport.protocol import Transport
from ..errors import PipelineError
from ..features.batchnorm import BatchNorms
from ..features.finite import FiniteCheck
from ..features.memory import ActivationMeter
from ..interrupt import note_steps
from .forensics import position
from .interpreter import Interpreter, Step
from .microbatch import Dims, merge
from .stage import Stage
from .step import prepare_window


@dataclass
class Runner:
    """Executes this rank's train and eval action lists and shares the step's losses."""

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
    windows: Windows | None = None  # an asynchronous schedule's windows (None: synchronous)
    last_step: Step | None = None
    running: tuple[Action, ...] = ()
    step_started: float = 0.0
    losses: dict[str, Any] = field(default_factory=dict)
    finite: FiniteCheck | None = None  # the check of non-finite values (see .finite), when set
    checked: bool = False  # whether this train step's collective check has run
    stepped: dict[int, int] = field(default_factory=dict)  # STEPs each stage ran in this step (asynchronous)
    per_minibatch: int = 0  # micro-batches per mini-batch of the step running
    trained: int = 0  # mini-batches trained before the step running (names a failing one in the stream)
    snapshots: Any = None  # snapshot=: told of each train step's end (stagewise.runtime.elastic)

    def guarded(self, body: Callable[[], Any]) -> Any:
        """Run ``body``; any failure is posted to the board (or annotated) with where this rank stood."""
        guard = self.transport.guard
        if guard.failure is not None:
            raise PipelineError(f"the pipeline failed earlier and cannot run again: {guard.failure}")
        try:
            return body()
        except PipelineError as err:
            raise PipelineError(f"{err}\n{self.position()}") from err
        except BaseException as err:
            guard.fail(f"{guard.me}: {type(err).__name__}: {err}\n{self.position()}")
            raise

    def position(self) -> str:
        """Where this rank stood in the action list it was running (see :mod:`.forensics`)."""
        step = self.last_step
        done = step.events[-1][0] if step is not None and step.events else None
        current = getattr(self.interpreter, "current", None)
        return position(self.rank, self.running, current, done, self.transport.guard.waiting)

    # ---- the protocol --------------------------------------------------------------------------
    def train(self, batches: Sequence[tuple[Any, Any]]) -> list[float]:
        """Train on ``batches`` (one mini-batch for a synchronous schedule, a window's for an asynchronous one);
        each mini-batch's mean loss, alike on every rank."""
        if self.windows is None:
            if len(batches) != 1:
                raise ValueError(f"a synchronous step trains one mini-batch, got {len(batches)}")
            actions = self.train_actions
        else:
            table, actions = self.windows.get(len(batches))
            self.interpreter.start_window(table)  # type: ignore[attr-defined]
        self.per_minibatch = self._microbatches(len(batches))
        step = self._prepare("train", batches, self.per_minibatch)
        self.tied.start_step()
        self.checked, self.stepped = False, {}
        if self.finite is not None:
            self.finite.begin()  # the buffers as they are: a refused or skipped step puts them back
        for st in self.stages.values():
            st.aux_totals = {}
        with self.meter.hooks() if self.meter is not None else nullcontext():
            if self.meter is not None:
                self.meter.reset()
            self._run(actions, step, len(batches))
        self.tied.finish()
        self.check_finite()  # when the list had no STEP (no optimizer factory), the check runs here
        losses = self._share_losses(step, len(batches))
        if self.hybrid is not None:  # wait for the gradient reductions; the mean over the replicas
            losses = self.hybrid.after_train(losses, self._samples(step), exact=self.loss_weights is not None)
        self.losses = {"loss": losses[-1], "aux_local": self._aux()}
        self.trained += len(batches)
        note_steps(len(batches))  # where a Ctrl-C finds this rank
        if self.snapshots is not None:
            self.snapshots.after_step()
        return losses

    def eval(self, inputs: Any, merge_outputs: bool) -> Any:
        step = self._prepare("eval", [(inputs, None)], self.schedule.num_microbatches)
        with torch.no_grad():
            self._run(self.eval_actions, step, 1)
        if self.hybrid is not None:
            self.hybrid.after_eval()
        if self.schedule.placement[-1] != self.rank:
            return None
        outputs = [step.outputs[i] for i in range(self.schedule.num_microbatches)]
        return merge(outputs) if merge_outputs else outputs

    def _run(self, actions: tuple[Action, ...], step: Step, minibatches: int) -> None:
        self.last_step, self.running = step, actions
        self.transport.guard.reset_waiting()  # "waiting for" must be this step's
        self.step_started = time.perf_counter()
        norms: AbstractContextManager[Any] = nullcontext()
        if self.norms is not None:
            norms = self.norms.step(step.mode, minibatches, self.per_minibatch)
        with norms:
            self.interpreter.run(actions, step)
        self.transport.finish_sends()

    def _prepare(self, mode: str, batches: Sequence[tuple[Any, Any]], m: int) -> Step:
        replicas = 1 if self.hybrid is None else self.hybrid.config.replicas
        weighted = self.loss_weights is not None and replicas > 1
        return prepare_window(
            mode,
            batches,
            rank=self.rank,
            placement=self.schedule.placement,
            num_microbatches=m,
            batch_dims=self.batch_dims,
            device=self.device,
            has_loss=self.has_loss,
            loss_weights=self.loss_weights,
            denominators=self._over_replicas if weighted and mode == "train" else None,
            defer_checks=True,  # counts on the device stay there: no read per micro-batch (see .step)
        )

    def _microbatches(self, minibatches: int) -> int:
        """Micro-batches per mini-batch."""
        if self.windows is None:
            return self.schedule.num_microbatches
        return self.windows.get(minibatches)[0].microbatches

    def _over_replicas(self, totals: torch.Tensor) -> torch.Tensor:
        """Each mini-batch's counted items over every data-parallel replica, divided by the replica count: the
        weights then make the replicas' averaged gradient the global batch's token mean, however unevenly the
        counted items fall over the replicas. (On the device, unread.)"""
        t = totals.to(self.device, torch.float64, non_blocking=True, copy=True)
        self.hybrid.mesh.all_reduce(t, ("dp", "sharding"), wait=self.transport.guard.wait, what="the counted items")
        return t / self.hybrid.config.replicas

    # ---- checks and results --------------------------------------------------------------------
    def check_finite(self) -> None:
        """The step-end check of non-finite values (:mod:`..features.finite`), once per synchronous train step:
        at its first STEP action (the schedule puts them at the end of each rank's list when checking) or after
        the list. Every gradient must be final first: tied sums and the hybrid axes' reductions are waited for.
        (Asynchronous schedules check each stage at each of its STEPs instead: :meth:`before_step`.)"""
        if self.finite is None or self.windows is not None or self.checked:
            return
        if self.last_step is None or self.last_step.mode != "train":
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
        """A stage part: a synchronous step's first STEP runs the collective check; an asynchronous window checks
        the stage's own mini-batch at each of its STEPs (no collective: the stages step at different times)."""
        if self.windows is None:
            self.check_finite()
            return
        if self.finite is None or self.last_step is None:
            return
        k = self.stepped.get(stage, 0)
        self.stepped[stage] = k + 1
        if self.hybrid is not None:
            self.hybrid.before_step(stage)
        m = self.per_minibatch
        last = stage == self.schedule.num_stages - 1
        losses = {i: v for i, v in self.last_step.losses.items() if i // m == k} if last else {}
        self.finite.check_stage(stage, self.trained + k, losses)

    def _share_losses(self, step: Step, n: int) -> list[float]:
        """Each mini-batch's mean loss: computed where the last stage lives, broadcast over the pipeline group.

        A collective every rank issues once per train step, after its action list (the one exchange of a
        step outside the schedule's point-to-point), and the step's one read of the device: the losses are
        weighted and summed where they are, and the check of counts kept on the device (:mod:`.step`) travels
        with them, so every rank refuses bad counts alike.
        """
        owner = self.schedule.placement[-1]
        buf = torch.zeros(n + 1, dtype=torch.float64, device=self.device)  # the losses, then "counts refused"
        if self.rank == owner:
            assert step.weights is not None
            m = len(step.weights) // n
            losses = torch.stack([step.losses[i] for i in range(n * m)]).reshape(-1).to(torch.float64)
            buf[:n] = (losses * _on_device(step.weights, self.device)).view(n, m).sum(1)
            if step.counts is not None:
                buf[n] = step.counts.bad.to(torch.float64)
        if self.schedule.num_ranks > 1:
            self.transport.broadcast(buf, owner, f"the step's losses from rank {owner}")
        values = buf.tolist()  # the step's one read of the device
        if values[n]:
            if step.counts is not None:
                raise step.counts.error()
            raise ValueError(f"rank {self.rank}: loss_weights returned a bad count on rank {owner} (the last stage's)")
        return values[:n]

    def _samples(self, step: Step) -> float | None:
        """The rows this rank's mini-batches trained on (where the last stage lives), for the replicas' check."""
        if step.targets is None:
            return None
        from .microbatch import batch_size

        return float(sum(batch_size(t, self.batch_dims[1], "targets") for t in step.targets))

    def _aux(self) -> dict[str, float]:
        """Each aux term's total over this rank's stages (one host read for all of them)."""
        totals: dict[str, Any] = {}
        for st in self.stages.values():
            for n, v in st.aux_totals.items():
                totals[n] = totals.get(n, 0.0) + v
        if not totals:
            return {}
        values = torch.stack([torch.as_tensor(v, dtype=torch.float64).reshape(()) for v in totals.values()])
        return dict(zip(totals, values.tolist()))


def _on_device(weights: list[Any], device: torch.device) -> torch.Tensor:
    """The micro-batches' weights as one float64 tensor on ``device`` (floats copied up without a wait)."""
    if weights and isinstance(weights[0], torch.Tensor):
        return torch.stack(weights)
    return torch.tensor(weights, dtype=torch.float64).to(device, non_blocking=True)
