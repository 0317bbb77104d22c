"""The interpreter: runs one rank's action list; the loop and the communication, the rest by a table.

It knows no schedule and no stage. Roughly:

  F, B, I, W    a handler from the table (:mod:`.compute`: run a stage, differentiate it), timed
  SEND_*        send a value a compute action left in the outbox (posted, waited for at the step's end)
  RECV_*        post a receive early; the compute action that consumes it waits for it
  SYNC, STEP    a handler from the table (:mod:`.hooks`: the stage's gradients are final; step its optimizer)

The table (kind -> ``handler(run, action)``) is filled by the assembly: the synchronous schedules' handlers,
or, for an asynchronous schedule, the version-aware ones (:mod:`..asynchronous.handlers`) in their place.
Every handler gets the run value (:class:`.run.Run`), which holds everything per run: nothing per run is kept
here.

A maximal run of non-compute actions is posted as one batch (sends, then
receives), as the schedule validator assumes. Values between two stages of the
same rank never touch the transport. Each action is timed with
``time.perf_counter``; a compute action's time starts once its input is there
(:mod:`.timings`: the format of what is recorded).

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
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ...ir import Action, Kind, Message, consumer_stage, consumes, message_of
from ..comm.faults.failures import comm_failure, is_comm_error
from ..comm.transport.protocol import Transport
from ..errors import PipelineError
from .compute import Handler
from .messages import Mailbox, describe
from .run import Run
from .timings import ActionEvent

#: the kinds the table holds (the communication is the interpreter's own)
HANDLED = (Kind.F, Kind.B, Kind.I, Kind.W, Kind.SYNC, Kind.STEP)


class Interpreter:
    """Executes action lists of one rank: the loop, the communication, and a handler per other kind."""

    def __init__(
        self,
        *,
        rank: int,
        placement: tuple[int, ...],
        transport: Transport,
        mailbox: Mailbox,
        handlers: Mapping[Kind, Handler] | None = None,
        slowdown: float = 1.0,
    ) -> None:
        self.rank = rank
        self.placement = placement
        self.transport = transport
        self.mailbox = mailbox
        self.handlers: dict[Kind, Handler] = {}
        for kind, handler in (handlers or {}).items():
            self.register(kind, handler)
        self.early = not transport.grouped  # post the step's receives at its start (see above)
        self.slowdown = slowdown  # EMULATION: each compute action takes this many times its time (RunOptions)
        self._orders: dict[int, tuple[Sequence[Action], list[Message]]] = {}

    def register(self, kind: Kind, handler: Handler) -> None:
        """Run ``handler(run, action)`` for each action of ``kind`` (replacing the one registered before)."""
        if kind not in HANDLED:
            raise ValueError(f"{kind.name} is the interpreter's own (the communication): only {HANDLED} take handlers")
        self.handlers[kind] = handler

    # ---- the loop --------------------------------------------------------
    def run(self, actions: Sequence[Action], run: Run) -> None:
        """Execute ``actions`` in order; on any failure post it so that no other rank waits forever."""
        run.exchange = self
        # the compute runs on this thread unless torch's intra-op pool helps: then the process's CPU (with the
        # transport's threads, a few percent) is the closer measure
        run.cpu_clock = time.thread_time if torch.get_num_threads() == 1 else time.process_time
        try:
            run.order, run.consumed = self._receive_order(actions), 0
            self._post_early(run)
            idx = 0
            while idx < len(actions):
                end = idx + 1
                if actions[idx].kind.is_compute:
                    self._timed_compute(run, actions[idx])
                else:
                    while end < len(actions) and not actions[end].kind.is_compute:
                        end += 1
                    self._batch(run, actions[idx:end])
                idx = end
            self._check_drained(run)
        except PipelineError:
            raise
        except BaseException as err:
            where = f" at {run.current}" if run.current is not None else ""
            if is_comm_error(err):  # a collective inside torch (FSDP2, DTensor): whose failure is it?
                raise comm_failure(self.transport.guard, err, f"{self.transport.guard.me}{where}") from err
            self.transport.guard.fail(f"{self.transport.guard.me}{where}: {type(err).__name__}: {err}")
            raise
        finally:
            run.inbox, run.outbox, run.pending, run.saved, run.sent = {}, {}, {}, {}, {}
            run.exchange = None

    def _timed_compute(self, run: Run, a: Action) -> None:
        run.current = a
        run.started = time.perf_counter()  # moved on by ready() once the input is there
        run.cpu_started = run.cpu_clock()
        self.handlers[a.kind](run, a)
        end = time.perf_counter()
        cpu = run.cpu_clock() - run.cpu_started
        if self.slowdown != 1.0:  # emulated heterogeneity: sleep (f - 1) x the measured time (no CPU taken)
            time.sleep((self.slowdown - 1.0) * (end - run.started))
            end = time.perf_counter()
        run.record.add_compute(a, run.started, end, cpu)

    def ready(self, run: Run) -> None:
        """The running compute action's input is there: its time starts now."""
        run.started = time.perf_counter()
        run.cpu_started = run.cpu_clock()

    def _batch(self, run: Run, actions: Sequence[Action]) -> None:
        """Post the run's sends and receives as one batch; then run its SYNC / STEP actions.

        SEND and RECV only collect; the batch is posted once all are in, and its posting time is shared evenly
        by its communication actions.
        """
        comm = [a for a in actions if a.kind.is_comm]
        events = run.record.events
        if comm:
            t0 = time.perf_counter()
            run.sends, run.recvs = [], []
            for a in comm:
                run.current = a
                if a.kind is Kind.SEND_F or a.kind is Kind.SEND_B:
                    self._send(run, a)
                else:
                    run.recvs.append(message_of(a))
            self._post(run, run.sends, [m for m in run.recvs if m not in run.pending])
            self._watch_next(run)
            share = (time.perf_counter() - t0) / len(comm)
            events.extend(ActionEvent(a, t0 + k * share, t0 + (k + 1) * share) for k, a in enumerate(comm))
        for a in actions:
            if not a.kind.is_comm:
                run.current = a
                t0 = time.perf_counter()
                self.handlers[a.kind](run, a)
                events.append(ActionEvent(a, t0, time.perf_counter()))

    def _post(self, run: Run, sends: list[tuple[Message, Any]], recvs: list[Message]) -> None:
        ops, pendings = self.mailbox.batch(sends, recvs, run.mode)
        works = self.transport.post(ops)
        received = {p.msg: p for p in pendings}
        for op, op_works in zip(ops, works):
            if not op.send:
                _add(received[op.key].works, op_works)
            elif op.key.direction == "F":
                _add(run.sent.setdefault(op.key, []), op_works)
        run.pending.update(received)

    # ---- receives ahead of the schedule ----------------------------------
    def _receive_order(self, actions: Sequence[Action]) -> list[Message]:
        """The messages the schedule receives from other ranks, in the order compute actions consume them (once
        per list: each of its kinds checked to have a handler)."""
        cached = self._orders.get(id(actions))
        if cached is not None and cached[0] is actions:
            return cached[1]
        missing = {a.kind for a in actions if not a.kind.is_comm} - set(self.handlers)
        if missing:
            raise ValueError(f"rank {self.rank}: no handler for {sorted(k.name for k in missing)} actions")
        received = {message_of(a) for a in actions if a.kind is Kind.RECV_F or a.kind is Kind.RECV_B}
        n = len(self.placement)
        order = [m for m in (consumes(a, n) for a in actions if a.kind.is_compute) if m is not None and m in received]
        self._orders[id(actions)] = (actions, order)
        return order

    def _post_early(self, run: Run) -> None:
        """Post the receive of every message whose shapes are known (the others' RECV takes them eagerly)."""
        if self.early:
            recvs = [m for m in run.order if self.mailbox.knows(m, run.mode)]
            if recvs:
                self._post(run, [], recvs)
        self._watch_next(run)

    def _watch_next(self, run: Run) -> None:
        """Have a helper wait for the next message to consume in the background, once its receive is posted."""
        if run.consumed < len(run.order):
            pending = run.pending.get(run.order[run.consumed])
            if pending is not None and pending.watch is None and pending.works:
                pending.watch = self.transport.watch(pending.works)

    # ---- values in and out (the handlers' exchange: run.take, run.deliver) -----------------------
    def deliver(self, run: Run, msg: Message, value: Any) -> None:
        if self.placement[consumer_stage(msg)] == self.rank:
            run.inbox[msg] = value
        else:
            run.outbox[msg] = value

    def take(self, run: Run, msg: Message) -> Any:
        if msg in run.inbox:
            return run.inbox.pop(msg)
        pending = run.pending.pop(msg, None)
        if pending is None:
            raise RuntimeError(f"{run.current} needs {describe(msg)}, but no receive for it was posted before")
        value = self.mailbox.receive(pending)
        run.consumed += 1
        self._watch_next(run)
        if msg.direction == "B":  # the next stage used our output to make this gradient: that send is done
            done = Message("F", msg.stage - 1, msg.microbatch)
            self.transport.release(run.sent.pop(done, []), f"the send of {describe(done)}")
        return value

    def _send(self, run: Run, a: Action) -> None:
        msg = message_of(a)
        if msg not in run.outbox:
            raise RuntimeError(f"{a} sends {describe(msg)}, which this rank has not computed yet")
        run.sends.append((msg, run.outbox.pop(msg)))

    def _check_drained(self, run: Run) -> None:
        left = [f"{describe(m)} (unsent)" for m in run.outbox] + [f"{describe(m)} (unused)" for m in run.pending]
        left += [f"{describe(m)} (unused)" for m in run.inbox]
        if run.mode == "train":
            left += [f"the backward of stage {s} micro-batch {i}" for s, i in run.saved]
        if left:
            raise RuntimeError(f"rank {self.rank}: the action list ended with work left over: {', '.join(left)}")


def _add(works: list[Any], more: list[Any]) -> None:
    """Append works not yet listed (on NCCL one group's works complete all of its ops)."""
    works.extend(w for w in more if all(w is not old for old in works))
