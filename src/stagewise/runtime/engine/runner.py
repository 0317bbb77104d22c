"""Running steps: the one step protocol, from the mini-batches to the losses every rank returns.

Every train step goes through :meth:`Runner.train`: a synchronous schedule's step (one mini-batch), an
asynchronous schedule's window (several mini-batches, each stage stepping at its own STEPs) and, through
those, every HetPipe wave. The runner does what every step needs, and nothing an option adds::

    actions = the train lists' actions for these mini-batches      (TrainLists: one list, or a window)
    run = the run value: the micro-batches where this rank needs them (.run, .batches)
    with every part's around(run):                                 (hooks, modes, resets, the merge's flag)
        the interpreter runs the actions, each handler given run
    the sends finish; the losses are shared (the step's one read of the device)
    every part's after(run), in order                              (sums waited for, checks, totals)

What an option adds to a step plugs in as a :class:`StepPart` (two methods, as a stage's SYNC and STEP take
a :class:`~.hooks.StagePart`), registered by the assembly: the gradient merge, the tied sums, the hybrid axes,
BatchNorm, the activation meter, the check of non-finite values, the aux totals, dropout's seeds. Each is
given the run value (:class:`.run.Run`), and reads what it needs of the run there. A failure on this rank is
posted to the error board with this rank's place in its action list (:mod:`.forensics`).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ...ir import Action, Schedule
from ..comm.faults import calls
from ..comm.transport.protocol import Transport
from ..errors import PipelineError
from ..interrupt import note_steps
from .batches import Batches
from .eval_inputs import Refused, agreed_record
from .forensics import position
from .hooks import AfterStep
from .interpreter import Interpreter
from .microbatch import merge
from .run import Run, RunRecord


class StepPart(Protocol):
    """A part of the pipeline with work around each run of the action list.

    ``around(run)``: a context held while the interpreter runs the actions (hooks on modules, a mode, a
    step's fresh state); left even when the run fails. ``after(run)``: the run finished and, for a train
    step, ``run.losses`` are shared: wait for what the run started, check, total; a part may replace
    ``run.losses`` (the replicas' mean). Each looks at ``run.mode`` for what concerns it.
    """

    def around(self, run: Run) -> AbstractContextManager[Any]: ...
    def after(self, run: Run) -> None: ...


class TrainLists(Protocol):
    """Which actions a train step of ``minibatches`` mini-batches runs (1 to :attr:`size`), the micro-batches of
    each, and what else its handlers need to know of that list (an asynchronous window's version table, which
    the run carries as ``run.table``; None): a synchronous schedule's one list (:class:`OneList`), or an
    asynchronous one's windows."""

    @property
    def size(self) -> int: ...
    def train(self, minibatches: int) -> tuple[tuple[Action, ...], int, Any]: ...


@dataclass(frozen=True)
class OneList:
    """A synchronous schedule's train lists: one mini-batch per step, the schedule's own actions."""

    actions: tuple[Action, ...]
    microbatches: int
    size: int = 1

    def train(self, minibatches: int) -> tuple[tuple[Action, ...], int, Any]:
        if minibatches != 1:
            raise ValueError(f"a synchronous step trains one mini-batch, got {minibatches}")
        return self.actions, self.microbatches, None


@dataclass
class Runner:
    """Executes this rank's train and eval action lists and shares the step's losses."""

    rank: int
    schedule: Schedule
    transport: Transport
    interpreter: Interpreter
    lists: TrainLists
    eval_actions: tuple[Action, ...]
    batches: Batches
    parts: list[StepPart] = field(default_factory=list)
    last_step: RunRecord | None = None  # the last run's record (its timeline: pipe.last_step)
    last_run: Run | None = None
    running: tuple[Action, ...] = ()
    step_started: float = 0.0
    losses: list[float] = field(default_factory=list)  # the last train step's (each mini-batch's mean loss)
    trained: int = 0  # mini-batches trained before the step running (names a failing one in the stream)
    closed: bool = False  # pipe.close() let go of the groups: nothing runs again
    eval_size: int | None = None  # the last evaluation's batch size (.eval_inputs)
    late: AfterStep | None = None  # what raised after a stage stepped in the last train step, to raise after it

    def guarded(self, body: Callable[[], Any], call: str) -> Any:
        """Run ``body``, the collective ``call`` (counted: :mod:`..comm.faults.calls`); any failure is posted to
        the board (or annotated) with where this rank stood."""
        guard = self.transport.guard
        if self.closed:
            raise PipelineError(f"rank {self.rank}: this Pipeline was closed (pipe.close()): build a new one to train")
        if guard.failure is not None:
            raise PipelineError(f"the pipeline failed earlier and cannot run again: {guard.failure}")
        before = self.last_run  # (a failure before this call's actions ran is placed before them)
        try:
            with calls.call(call, guard.scope):
                return body()
        except Refused:  # refused alike on every rank before anything was sent: nothing failed
            raise
        except PipelineError as err:
            raise PipelineError(f"{err}\n{self.position(call, before)}") from err
        except BaseException as err:
            guard.fail_with(err, self.position(call, before))
            raise

    def position(self, call: str = "", before: Run | None = None) -> str:
        """Where this rank stood in the action list it was running (see :mod:`.forensics`); ``call`` and
        ``before`` (its last run when ``call`` began): if no run began since, a line saying so, not the last
        run's place."""
        if call and self.last_run is before:
            return f"rank {self.rank} in {call}, before its actions ran"
        step = self.last_step
        done = step.events[-1][0] if step is not None and step.events else None
        current = self.last_run.current if self.last_run is not None else None
        return position(self.rank, self.running, current, done, self.transport.guard.waiting)

    # ---- the protocol --------------------------------------------------------------------------
    def train(self, batches: Sequence[tuple[Any, Any]]) -> list[float]:
        """Train on ``batches`` (one mini-batch for a synchronous schedule, a window's for an asynchronous one);
        each mini-batch's mean loss, alike on every rank."""
        n = len(batches)
        actions, m, table = self.lists.train(n)
        run = Run("train", self.batches.prepare("train", batches, m), n, m, self.trained, table=table)
        self._run(actions, run)
        run.losses = self._share_losses(run.record, n)
        for part in self.parts:
            part.after(run)
        self.losses = run.losses
        self.trained += n
        note_steps(n)  # where a Ctrl-C finds this rank
        self.late = run.late[0] if run.late else None
        return run.losses

    def raise_late(self) -> None:
        """Raise what raised after a stage stepped in the last train step (an LR scheduler's error), once that step
        is done and counted on every rank: the pipeline stays whole (:class:`.hooks.AfterStep`)."""
        late, self.late = self.late, None
        if late is not None:
            note = (
                f"stagewise: stage {late.stage}'s LR scheduler raised after its optimizer stepped; the train step "
                "ran to its end on every rank and counts (pipe.train_steps): the pipeline can go on, evaluate or "
                "be saved"
            )
            if sys.version_info >= (3, 11):
                late.error.add_note(note)
            else:  # pragma: no cover (no notes before 3.11: the log says it)
                logging.getLogger(__name__).warning(note)
            raise late.error

    def eval(self, inputs: Any, merge_outputs: bool) -> Any:
        m = self.schedule.num_microbatches
        run = Run("eval", agreed_record(self, inputs, m), 1, m, self.trained)
        with torch.no_grad():
            self._run(self.eval_actions, run)
        for part in self.parts:
            part.after(run)
        if self.schedule.placement[-1] != self.rank:
            return None
        outputs = [run.record.outputs[i] for i in range(m)]
        return merge(outputs) if merge_outputs else outputs

    def _run(self, actions: tuple[Action, ...], run: Run) -> None:
        self.last_step, self.last_run, self.running = run.record, run, actions
        self.transport.guard.reset_waiting()  # "waiting for" must be this step's
        with ExitStack() as parts:
            for part in self.parts:
                parts.enter_context(part.around(run))
            self.step_started = time.perf_counter()
            self.interpreter.run(actions, run)
        self.transport.finish_sends()

    # ---- results -------------------------------------------------------------------------------
    def _share_losses(self, step: RunRecord, n: int) -> list[float]:
        """Each mini-batch's mean loss: computed where the last stage lives, broadcast over the pipeline group.

        A collective every rank issues once per train step, after its action list (the one exchange of a
        step outside the schedule's point-to-point), and the step's one read of the device: the losses are
        weighted and summed where they are, and the check of counts kept on the device (:mod:`.batches`) travels
        with them, so every rank refuses bad counts alike.
        """
        owner = self.schedule.placement[-1]
        device = self.batches.device
        buf = torch.zeros(n + 1, dtype=torch.float64, device=device)  # the losses, then "counts refused"
        if self.rank == owner:
            assert step.weights is not None
            m = len(step.weights) // n
            losses = torch.stack([step.losses[i] for i in range(n * m)]).reshape(-1).to(torch.float64)
            buf[:n] = (losses * _on_device(step.weights, device)).view(n, m).sum(1)
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


def _on_device(weights: list[Any], device: torch.device) -> torch.Tensor:
    """The micro-batches' weights as one float64 tensor on ``device`` (floats copied up without a wait)."""
    if weights and isinstance(weights[0], torch.Tensor):
        return torch.stack(weights)
    return torch.tensor(weights, dtype=torch.float64).to(device, non_blocking=True)
