"""The interpreter: runs one rank's action list, one small handler per action kind.

It knows no schedule. Roughly:

  F       take the stage's input (data, a local stage's output, or a posted receive), run the
          stage; the last stage applies the loss, weighted by its micro-batch's share of the batch
  B       one backward for the stage and micro-batch; hand the input gradient on
  I       one backward pass that frees the graph: the input gradient and every parameter gradient but
          the deferred weights', whose op inputs and output gradients it stashes (see :mod:`.backward`)
  W       the deferred weight gradients, from I's stash
  SEND_*  send a value a compute action left in the outbox (posted, waited for at the step's end)
  RECV_*  post a receive early; the compute action that consumes it waits for it
  SYNC    the stage's gradients are final: run the sync hooks (data-parallel reduction goes here)
  STEP    step the stage's optimizer, if the pipeline has one

A maximal run of non-compute actions is posted as one batch (sends, then
receives), as the schedule validator assumes. Values between two stages of the
same rank never touch the transport. Each action is timed with
``time.perf_counter``; a compute action's time starts once its input is there.

Receives ahead of the schedule: on a transport that posts each op alone (gloo),
a value only travels once its receive is posted, so a receive posted just
before its consumer costs a round trip to the sender whenever the sender was
ahead (measured on a busy 2-core machine: 0.6-0.9 ms median, 5-8 ms at the
90th percentile, against 30 us for a receive posted in time: the sender's I/O
thread must be scheduled again). So, once shapes are known, every receive of
the step is posted when the step starts; the schedule's own RECV finds it
posted. Posting a receive early cannot deadlock (it blocks nobody), cannot
take another step's value (each step's receives are complete before the next
is posted) and changes no result; the cost is memory: the step's incoming
boundary values are allocated at its start (at most two per micro-batch and
local stage). And a helper thread waits, in the background, for the next
value the rank will consume (:meth:`Transport.watch`), so taking a value that
has arrived costs no thread hand-off. Grouped backends (NCCL) post exactly
where the schedule says.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ...ir import Action, Kind, Message, consumer_stage, consumes, message_of
from ..comm.faults.failures import comm_failure, is_comm_error
from ..comm.transport.protocol import Transport
from ..errors import PipelineError
from .backward import WeightWork, backward_full, backward_input, backward_weight
from .hooks import StageHooks
from .messages import Mailbox, Pending, describe
from .timings import ActionEvent, StepTimings
from .tree import flatten, unflatten

#: the elements of a stage's largest 2-D weight from which its B runs as I then W at once (see ``_fuse_b``)
FUSE_B_MIN_WEIGHTS = 1 << 20


def fuses_b(params: Iterable[torch.Tensor]) -> bool:
    """Whether B of a stage (not recomputed) with these parameters runs as I then W at once (see ``_fuse_b``)."""
    return max((p.numel() for p in params if p.dim() == 2), default=0) >= FUSE_B_MIN_WEIGHTS


class StashMeter(Protocol):
    """What the interpreter tells a memory meter (``measure_memory=``, :mod:`..features.memory`): the bytes each
    I leaves for its W, until that W ends."""

    def hold(self, at: tuple[int, int], nbytes: int) -> None: ...

    def drop(self, at: tuple[int, int]) -> None: ...


@dataclass
class Step(StepTimings):
    """One step's data and results: micro-batches in, losses or outputs out, and what the run recorded
    (``events``, ``compute_cpu``: :mod:`.timings`)."""

    mode: str  # "train" or "eval"
    inputs: list[Any] | None  # micro-batches, for the rank holding stage 0
    targets: list[Any] | None  # for the rank holding the last stage
    weights: list[Any] | None  # each micro-batch's share of the batch (a float, or a 0-dim tensor on the device)
    losses: dict[int, torch.Tensor] = field(default_factory=dict)
    outputs: dict[int, Any] = field(default_factory=dict)
    #: counts of ``loss_weights`` kept on the device, checked with the losses (``.step.DeferredCounts``), or None
    counts: Any = None


@dataclass
class _Saved:
    """What a stage's backward for one micro-batch needs from its forward."""

    inputs: list[torch.Tensor]  # the differentiable input leaves (their gradients go back)
    roots: list[torch.Tensor]  # floating outputs, or the weighted loss on the last stage
    weight_work: WeightWork | None = None


class Interpreter:
    """Executes action lists for the stages ``stages`` (index -> callable) of one rank."""

    def __init__(
        self,
        *,
        rank: int,
        placement: tuple[int, ...],
        stages: dict[int, Callable[[Any], Any]],
        loss_fn: Callable[..., torch.Tensor] | None,
        transport: Transport,
        mailbox: Mailbox,
        hooks: StageHooks,
    ) -> None:
        self.rank = rank
        self.placement = placement
        self.last = len(placement) - 1
        self.stages = stages
        self.loss_fn = loss_fn
        self.transport = transport
        self.mailbox = mailbox
        self.hooks = hooks
        self._fuse_cache: dict[int, bool] = {}
        self._checkpoint_cache: dict[int, tuple[torch.Tensor, ...]] = {}
        self.meter: StashMeter | None = None  # the memory meter, if on: charged what W holds
        self.compute: dict[Kind, Callable[[Action], None]] = {
            Kind.F: self._forward,
            Kind.B: self._backward,
            Kind.I: self._backward_input,
            Kind.W: self._backward_weight,
        }
        self.comm: dict[Kind, Callable[[Action], None]] = {
            Kind.SEND_F: self._send,
            Kind.SEND_B: self._send,
            Kind.RECV_F: self._recv,
            Kind.RECV_B: self._recv,
        }
        self.other: dict[Kind, Callable[[Action], None]] = {Kind.SYNC: self._sync, Kind.STEP: self._step}
        self.early = not transport.grouped  # post the step's receives at its start (see above)
        self.slowdown = 1.0  # EMULATION: each compute action takes this many times its time (RunOptions)
        self._orders: dict[int, tuple[Sequence[Action], list[Message]]] = {}

    # ---- the loop --------------------------------------------------------
    def run(self, actions: Sequence[Action], step: Step) -> None:
        """Execute ``actions`` in order; on any failure post it so that no other rank waits forever."""
        self.step = step
        self.inbox: dict[Message, Any] = {}  # values from a stage on this rank
        self.outbox: dict[Message, Any] = {}  # values made here, waiting for their SEND
        self.pending: dict[Message, Pending] = {}  # posted receives
        self.sent: dict[Message, list[Any]] = {}  # works of posted forward sends, released once used
        self.saved: dict[tuple[int, int], _Saved] = {}
        self.current: Action | None = None
        # the compute runs on this thread unless torch's intra-op pool helps: then the process's CPU (with the
        # transport's threads, a few percent) is the closer measure
        self._cpu_clock = time.thread_time if torch.get_num_threads() == 1 else time.process_time
        self.order = self._receive_order(actions)
        self.consumed = 0  # how many of them were taken
        try:
            self._post_early()
            idx = 0
            while idx < len(actions):
                end = idx + 1
                if actions[idx].kind.is_compute:
                    self._timed_compute(actions[idx])
                else:
                    while end < len(actions) and not actions[end].kind.is_compute:
                        end += 1
                    self._batch(actions[idx:end])
                idx = end
            self._check_drained()
        except PipelineError:
            raise
        except BaseException as err:
            where = f" at {self.current}" if self.current is not None else ""
            if is_comm_error(err):  # a collective inside torch (FSDP2, DTensor): whose failure is it?
                raise comm_failure(self.transport.guard, err, f"{self.transport.guard.me}{where}") from err
            self.transport.guard.fail(f"{self.transport.guard.me}{where}: {type(err).__name__}: {err}")
            raise
        finally:
            self.inbox = self.outbox = {}
            self.pending, self.saved, self.sent = {}, {}, {}

    def _timed_compute(self, a: Action) -> None:
        self.current = a
        self._start = time.perf_counter()  # moved on by _ready() once the input is there
        self._cpu = self._cpu_clock()
        self.compute[a.kind](a)
        end = time.perf_counter()
        cpu = self._cpu_clock() - self._cpu
        if self.slowdown != 1.0:  # emulated heterogeneity: sleep (f - 1) x the measured time (no CPU taken)
            time.sleep((self.slowdown - 1.0) * (end - self._start))
            end = time.perf_counter()
        self.step.add_compute(a, self._start, end, cpu)

    def _ready(self) -> None:
        self._start = time.perf_counter()
        self._cpu = self._cpu_clock()

    def _batch(self, actions: Sequence[Action]) -> None:
        """Post the run's sends and receives as one batch; then run its SYNC / STEP actions.

        SEND and RECV handlers only collect; the batch is posted once all are
        in, and its posting time is shared evenly by its communication actions.
        """
        comm = [a for a in actions if a.kind.is_comm]
        if comm:
            t0 = time.perf_counter()
            self._sends: list[tuple[Message, Any]] = []
            self._recvs: list[Message] = []
            for a in comm:
                self.current = a
                self.comm[a.kind](a)
            self._post(self._sends, [m for m in self._recvs if m not in self.pending])
            self._watch_next()
            share = (time.perf_counter() - t0) / len(comm)
            self.step.events.extend(ActionEvent(a, t0 + k * share, t0 + (k + 1) * share) for k, a in enumerate(comm))
        for a in actions:
            if not a.kind.is_comm:
                self.current = a
                t0 = time.perf_counter()
                self.other[a.kind](a)
                self.step.events.append(ActionEvent(a, t0, time.perf_counter()))

    def _post(self, sends: list[tuple[Message, Any]], recvs: list[Message]) -> None:
        ops, pendings = self.mailbox.batch(sends, recvs, self.step.mode)
        works = self.transport.post(ops)
        received = {p.msg: p for p in pendings}
        for op, op_works in zip(ops, works):
            if not op.send:
                _add(received[op.key].works, op_works)
            elif op.key.direction == "F":
                _add(self.sent.setdefault(op.key, []), op_works)
        self.pending.update(received)

    # ---- receives ahead of the schedule ----------------------------------
    def _receive_order(self, actions: Sequence[Action]) -> list[Message]:
        """The messages the schedule receives from other ranks, in the order compute actions consume them."""
        cached = self._orders.get(id(actions))
        if cached is not None and cached[0] is actions:
            return cached[1]
        received = {message_of(a) for a in actions if a.kind is Kind.RECV_F or a.kind is Kind.RECV_B}
        n = len(self.placement)
        order = [m for m in (consumes(a, n) for a in actions if a.kind.is_compute) if m is not None and m in received]
        self._orders[id(actions)] = (actions, order)
        return order

    def _post_early(self) -> None:
        """Post the receive of every message whose shapes are known (the others' RECV takes them eagerly)."""
        if self.early:
            mode = self.step.mode
            recvs = [m for m in self.order if self.mailbox.knows(m, mode)]
            if recvs:
                self._post([], recvs)
        self._watch_next()

    def _watch_next(self) -> None:
        """Have a helper wait for the next message to consume in the background, once its receive is posted."""
        if self.consumed < len(self.order):
            pending = self.pending.get(self.order[self.consumed])
            if pending is not None and pending.watch is None and pending.works:
                pending.watch = self.transport.watch(pending.works)

    # ---- values in and out -----------------------------------------------
    def _deliver(self, msg: Message, value: Any) -> None:
        if self.placement[consumer_stage(msg)] == self.rank:
            self.inbox[msg] = value
        else:
            self.outbox[msg] = value

    def _take(self, msg: Message) -> Any:
        if msg in self.inbox:
            return self.inbox.pop(msg)
        pending = self.pending.pop(msg, None)
        if pending is None:
            raise RuntimeError(f"{self.current} needs {describe(msg)}, but no receive for it was posted before")
        value = self.mailbox.receive(pending)
        self.consumed += 1
        self._watch_next()
        if msg.direction == "B":  # the next stage used our output to make this gradient: that send is done
            done = Message("F", msg.stage - 1, msg.microbatch)
            self.transport.release(self.sent.pop(done, []), f"the send of {describe(done)}")
        return value

    def _send(self, a: Action) -> None:
        msg = message_of(a)
        if msg not in self.outbox:
            raise RuntimeError(f"{a} sends {describe(msg)}, which this rank has not computed yet")
        self._sends.append((msg, self.outbox.pop(msg)))

    def _recv(self, a: Action) -> None:
        self._recvs.append(message_of(a))

    # ---- compute ---------------------------------------------------------
    def _forward(self, a: Action) -> None:
        s, i = a.stage, a.microbatch
        assert i is not None
        train = self.step.mode == "train"
        if s == 0:
            assert self.step.inputs is not None
            x, leaves = self.step.inputs[i], list[torch.Tensor]()
        else:
            x = self._take(Message("F", s - 1, i))
            x, leaves = _as_leaves(x) if train else (x, [])
        self._ready()
        with torch.set_grad_enabled(train):
            out = self.stages[s](x)
        if s == self.last:
            if train:
                loss = self._loss(out, i)
                self.saved[(s, i)] = _Saved(leaves, [loss * self.step.weights[i]])  # type: ignore[index]
            else:
                self.step.outputs[i] = out
            return
        if train:
            self.saved[(s, i)] = _Saved(leaves, [t for t in flatten(out)[0] if t.requires_grad])
        self._deliver(Message("F", s, i), out)

    def _loss(self, out: Any, i: int) -> torch.Tensor:
        if self.loss_fn is None:
            raise ValueError("train_step needs a loss: build the Pipeline with loss_fn=...")
        assert self.step.targets is not None
        loss = self.loss_fn(out, self.step.targets[i])
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ValueError(f"loss_fn must return a scalar tensor (the micro-batch's mean loss), got {shape}")
        self.step.losses[i] = loss.detach()
        return loss.reshape(())

    def _output_grads(self, s: int, i: int, n: int) -> list[torch.Tensor | None]:
        if s == self.last:
            return [None]
        grads = list(self._take(Message("B", s + 1, i)))
        if len(grads) != n:
            raise RuntimeError(f"stage {s} micro-batch {i}: got {len(grads)} output gradients for {n} outputs")
        return grads

    def _hand_back(self, s: int, i: int, inputs: list[torch.Tensor], grads: list[torch.Tensor | None]) -> None:
        if s > 0:
            value = tuple(torch.zeros_like(x) if g is None else g for x, g in zip(inputs, grads))
            self._deliver(Message("B", s, i), value)

    def _backward(self, a: Action) -> None:
        s, i = a.stage, a.microbatch
        saved = self._saved_for(a)
        del self.saved[(s, i)]  # type: ignore[arg-type]
        grads = self._output_grads(s, i, len(saved.roots))  # type: ignore[arg-type]
        self._ready()
        got = backward_full(saved.roots, grads, saved.inputs, fused=self._fuse_b(s))
        self._hand_back(s, i, saved.inputs, got)  # type: ignore[arg-type]

    def _fuse_b(self, s: int) -> bool:
        """Whether B of stage ``s`` runs as I then W at once (see :mod:`.backward`) rather than one engine pass.

        Not for a recomputed stage (its B is the engine's, recompute included). I then W saves, per linear
        layer, the engine's temporary weight gradient and its add into ``.grad`` (a pass over a weight-sized
        matrix, freshly allocated), and pays I's graph walk and hooks and W's second read of each layer's
        input and output gradient: it pays where a stage has a weight of :data:`FUSE_B_MIN_WEIGHTS` elements
        or more. Measured (one thread, 2-core CPU; benchmarks/split_backward.py): two 1024 x 1024 linear
        layers 2.8 ms against the engine's 3.6 (8 rows), 14.9 against 16.4 (128 rows); a GPT stage of four
        d 256 blocks (largest weight 256 x 1024), 128 rows: 28-32 ms either way, the engine 2-4 % ahead.
        """
        known = self._fuse_cache.get(s)
        if known is None:
            stage = self.stages[s]
            params = [p for m in getattr(stage, "modules", ()) for p in m.parameters()]
            known = getattr(stage, "recompute", None) is None and fuses_b(params)
            self._fuse_cache[s] = known
        return known

    def _checkpointed(self, s: int) -> tuple[torch.Tensor, ...]:
        """The parameters a recomputed stage uses inside its checkpointed segments (all of its layers')."""
        known = self._checkpoint_cache.get(s)
        if known is None:
            stage = self.stages[s]
            recomputed = getattr(stage, "recompute", None) is not None
            known = tuple(p for m in getattr(stage, "modules", ()) for p in m.parameters()) if recomputed else ()
            self._checkpoint_cache[s] = known
        return known

    def _saved_for(self, a: Action) -> _Saved:
        saved = self.saved.get((a.stage, a.microbatch))  # type: ignore[arg-type]
        if saved is None:
            raise RuntimeError(f"{a}: stage {a.stage} has no forward of micro-batch {a.microbatch} to differentiate")
        if saved.weight_work is not None:
            raise RuntimeError(
                f"{a}: the input gradient of stage {a.stage} micro-batch {a.microbatch} was made already"
            )
        return saved

    def _backward_input(self, a: Action) -> None:
        s, i = a.stage, a.microbatch
        saved = self._saved_for(a)
        grads = self._output_grads(s, i, len(saved.roots))  # type: ignore[arg-type]
        self._ready()
        input_grads, work = backward_input(saved.roots, grads, saved.inputs, checkpointed=self._checkpointed(s))
        saved.roots = []  # the graph goes: only W's stash is left
        self._hand_back(s, i, saved.inputs, input_grads)  # type: ignore[arg-type]
        saved.inputs = []
        saved.weight_work = work
        if self.meter is not None:
            self.meter.hold((s, i), work.held_bytes())  # type: ignore[arg-type]

    def _backward_weight(self, a: Action) -> None:
        s, i = a.stage, a.microbatch
        saved = self.saved.get((s, i))  # type: ignore[arg-type]
        if saved is None or saved.weight_work is None:
            raise RuntimeError(
                f"{a}: W of stage {s} micro-batch {i} before its I (or after its W): "
                "there are no stashed weight-gradient inputs for it"
            )
        del self.saved[(s, i)]  # type: ignore[arg-type]
        backward_weight(saved.weight_work)
        if self.meter is not None:
            self.meter.drop((s, i))  # type: ignore[arg-type]

    # ---- per stage -------------------------------------------------------
    def _sync(self, a: Action) -> None:
        self.hooks.sync(a.stage)

    def _step(self, a: Action) -> None:
        self.hooks.step(a.stage)

    def _check_drained(self) -> None:
        left = [f"{describe(m)} (unsent)" for m in self.outbox] + [f"{describe(m)} (unused)" for m in self.pending]
        left += [f"{describe(m)} (unused)" for m in self.inbox]
        if self.step.mode == "train":
            left += [f"the backward of stage {s} micro-batch {i}" for s, i in self.saved]
        if left:
            raise RuntimeError(f"rank {self.rank}: the action list ended with work left over: {', '.join(left)}")


def _add(works: list[Any], more: list[Any]) -> None:
    """Append works not yet listed (on NCCL one group's works complete all of its ops)."""
    works.extend(w for w in more if all(w is not old for old in works))


def _as_leaves(value: Any) -> tuple[Any, list[torch.Tensor]]:
    """``value`` with each tensor that requires grad replaced by a fresh leaf that does (the stage's own graph).

    Tensors that needed no gradient on the sending stage (masks, ids, frozen or detached values; flagged in the
    message meta) stay as they are: no gradient is computed or sent back for them.
    """
    tensors, spec = flatten(value)
    leaves = [t.detach().requires_grad_(True) if t.requires_grad else t for t in tensors]
    return unflatten(spec, leaves), [t for t in leaves if t.requires_grad]
