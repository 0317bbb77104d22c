"""The guard: one per pipeline, so that no rank waits forever and every failure names the rank at fault.

Why one object: every transport (torch point-to-point, shared memory, one a
user writes) and every collective the pipeline issues outside its transport
(the hybrid axes' reductions, tied sums, gathers of records) must stop at the
same deadline and at the same posted failure, and name this rank the same
way. So the pipeline makes one :class:`Guard` and gives it to its transport
(:class:`~stagewise.runtime.comm.transport.protocol.TransportSpec`) and to its
collectives. A transport moves values and asks its guard whenever it waits;
it holds no board, deadline or forensics of its own.

What a guard owns:

* the error board (:mod:`.board`): :attr:`Guard.failure`, :meth:`Guard.fail`,
  :meth:`Guard.check` (a store round trip), :meth:`Guard.live` (none), and
  :meth:`Guard.when_failed`, for what must happen as soon as this rank learns
  of a failure (the shm transport removes its names from /dev/shm);
* the deadline: :meth:`Guard.wait` on torch works (gloo's on helper threads,
  :mod:`.waiters`; NCCL's only order streams), :meth:`Guard.watch` to start such
  a wait early, :meth:`Guard.call` for a blocking call, and
  :meth:`Guard.check_deadline` for waits that poll (the shm doorbells, a CUDA
  event: :meth:`Guard.wait_gpu`). A wait behind the others' slow local work
  (a checkpoint's writing and hashing) may be given ``patience``: it goes on
  past the timeout while every rank shows signs of life, and ends as soon as
  one stops;
* the first words of every failure it posts name the rank at fault when the
  heartbeat tells it (a rank silent past half the timeout, or one that stopped
  stamping when gloo reported a closed connection), not the neighbour this
  rank happened to wait for;
* forensics: :attr:`Guard.waiting`, what this rank waited for last (the hang
  report, :mod:`stagewise.runtime.engine.forensics`), which each step clears
  (:meth:`Guard.reset_waiting`); :attr:`Guard.me`, how messages name this rank;
* the process's heartbeat (:mod:`.heartbeat`, started with the first guard)
  and exit hook (:mod:`.exit_hook`, installed), which a failing rank leans on.

What it does not own: process groups and the values that travel (the transports).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ...errors import PipelineError
from ..coordinator import start_call
from . import divergence, exit_hook, heartbeat
from .board import ErrorBoard
from .calls import LOOK_AFTER_S
from .waiters import Waiters, Watch, poll_s

T = TypeVar("T")


class Guard:
    """One pipeline's error board, deadline and forensics, shared by its transport and its collectives.

    ``board``: the board's name (pipelines sharing one see each other's failures: one per mesh); ``me``: how
    messages name this rank; ``orders_streams``: waits on works of the pipeline's backend only order CUDA
    streams (NCCL), the CPU goes on; ``scope``: the pipeline's name, alike on its ranks (default: the board's).
    """

    def __init__(
        self,
        board: str,
        timeout: float,
        me: str,
        *,
        store: Any = None,
        orders_streams: bool = False,
        scope: str | None = None,
    ) -> None:
        self.me = me
        self.scope = board if scope is None else scope  # whose collective calls it counts (:mod:`.calls`)
        self.timeout = timeout
        self.orders_streams = orders_streams
        self.board = ErrorBoard(board, store, timeout, me)
        heartbeat.start(timeout)  # so that a rank whose deadline passes can name the silent ones
        exit_hook.install()  # a rank that fails outside any wait still posts, and leaves with exit code 1
        self.waiting = ""  # the last thing waited for, named in the hang report (see engine.forensics)
        self._waiters = Waiters()
        self._next_look = 0.0  # when a long wait next reads the peers' collective calls (:meth:`_diverged`)

    # ---- the error board ------------------------------------------------------------------------
    @property
    def failure(self) -> str | None:
        """The failure that stands, as far as this rank knows (no store round trip), or None."""
        return self.board.failure

    def fail(self, message: str) -> str:
        """Post ``message`` unless a failure came first; returns the failure that stands."""
        return self.board.fail(message)

    def fail_with(self, err: BaseException, where: str = "") -> str:
        """Post ``err`` as this rank's failure (``where``: the position line after it), as :meth:`fail` does."""
        return self.fail(f"{self.me}: {type(err).__name__}: {err}" + (f"\n{where}" if where else ""))

    def check(self) -> None:
        """Raise :class:`PipelineError` if any rank has posted a failure (asks the store)."""
        self.board.check()

    def live(self) -> None:
        """Raise :class:`PipelineError` if a failure is known here (no store round trip: waits look while waiting)."""
        if self.board.failure is not None:
            raise PipelineError(self.board.failure)

    def when_failed(self, fn: Callable[[], None]) -> None:
        """Run ``fn()`` once, as soon as this rank learns of a failure (at once if it already knows of one)."""
        self.board.when_failed(fn)

    # ---- forensics ------------------------------------------------------------------------------
    def reset_waiting(self) -> None:
        """A step starts: what the last one waited for is no longer news (see engine.forensics)."""
        self.waiting = ""

    # ---- deadline-bounded waits -----------------------------------------------------------------
    def watch(self, works: Sequence[Any]) -> Watch | None:
        """Start waiting for ``works`` on a helper thread; pass the result to :meth:`wait` (None: nothing to watch)."""
        if not works or self.board.failure is not None or self.orders_streams:
            return None
        return self._waiters.submit(works)

    def wait(
        self,
        works: Sequence[Any],
        what: str,
        *,
        watch: Watch | None = None,
        blocking: bool = False,
        patience: float | None = None,
    ) -> None:
        """Block until ``works`` complete, raising :class:`PipelineError` on any rank's failure or the deadline.

        ``blocking``: the works block a thread until done even where the backend only orders streams (gloo
        works next to NCCL: the eager side group), so they are waited for on a helper thread too.
        ``patience``: a wait behind slow local work of the others (writing or hashing a checkpoint) may last up
        to this long, past the timeout, while every rank shows signs of life (see :meth:`check_deadline`).
        """
        if not works:
            return
        self.live()
        self.waiting = what
        if self.orders_streams and not blocking:  # NCCL: orders streams and returns; the step's end syncs
            for w in works:
                w.wait()
            return
        job = self._waiters.submit(works) if watch is None else watch
        if not job.event.is_set():
            started = time.perf_counter()
            while not job.event.wait(poll_s(time.perf_counter() - started)):
                try:
                    self.check_deadline(started, what, patience)
                except PipelineError:
                    self._waiters.abandon(job.waiter)  # its thread is stuck in gloo; leave it behind
                    raise
        if job.error is not None:
            if self.board.failure is None:  # which peer went away? gloo does not say
                self._post_comm_error(what, job.error)
            raise PipelineError(self.board.failure) from job.error

    def _post_comm_error(self, what: str, error: BaseException) -> None:
        """Post a failed wait, naming first the rank that stopped stamping (a killed peer), if one did."""
        try:
            self.board.check()  # the peer's own failure may have been posted meanwhile: that one stands
        except PipelineError:
            return
        ended = divergence.blame_ended(self.scope)  # no death: a script that ended (gloo's words about a crash mislead)
        if ended:
            self.board.fail(f"{ended} ({self.me} waited for {what})")
            return
        culprit = heartbeat.blame_failed(self.timeout)
        text = f"{self.me}: {what} failed: {error}"
        self.board.fail(f"{culprit}: {text}" if culprit else text)

    def call(self, fn: Callable[[], T], what: str) -> T:
        """``fn()`` on a helper thread (left behind if it never returns), bounded like :meth:`wait`.

        For a blocking call that cannot be made asynchronous (process-group creation).
        """
        self.live()
        self.waiting = what
        done, box = start_call(fn)
        started = time.perf_counter()
        while not done.wait(poll_s(time.perf_counter() - started)):
            self.check_deadline(started, what)
        if "error" in box:
            err = box["error"]
            raise PipelineError(self.board.fail(f"{self.me}: {what} failed: {err}")) from err
        value: T = box["value"]
        return value

    def check_deadline(self, started: float, what: str, patience: float | None = None) -> None:
        """Raise if a failure was posted, or post one if ``what`` has been waited for past the timeout.

        The message names first the ranks that stopped showing signs of life, when some did (a stopped rank
        two hops away is the one at fault, not the neighbour this rank waits for). With ``patience``, the wait
        goes on past the timeout while no rank is silent, up to ``patience`` seconds. The board is read without
        blocking (:meth:`~.board.ErrorBoard.poll`): a failure posted elsewhere stands here one poll later.
        """
        self.board.poll()
        waited = time.perf_counter() - started
        if waited > LOOK_AFTER_S:
            self._diverged()
        if waited <= self.timeout:
            return
        self.board.poll(finish=True)  # the store host not answering is the cause, where it is
        culprit = heartbeat.blame_silent(self.timeout)
        if not culprit and patience is not None and waited <= patience:
            return
        limit = self.timeout if patience is None or culprit else patience
        if culprit:
            text = f"{culprit}; {self.me} waited {waited:.1f} s for {what} (timeout={limit:g} s)"
        else:
            text = f"{self.me} waited {waited:.1f} s for {what}; is another rank stuck or dead? (timeout={limit:g} s)"
        raise PipelineError(self.board.fail(text))

    def _diverged(self) -> None:
        """A wait of a few seconds reads the peers' collective calls, once a stamp: a peer in another call than
        this rank's (``if rank == 0: save(...)``), or whose script ended, is why - said now, not at the deadline."""
        now = time.monotonic()
        if now < self._next_look:
            return
        self._next_look = now + heartbeat.INTERVAL_S
        text = divergence.diverged(self.me, self.scope)
        if text:
            raise PipelineError(self.board.fail(text))

    def wait_gpu(self, device: torch.device, what: str, patience: float | None = None) -> None:
        """On CUDA, wait for the queued kernels and transfers by polling an event (a GPU wait cannot be handed
        to a helper thread without blocking it), within the deadline (``patience``: as for :meth:`wait`);
        nothing on other devices."""
        if device.type != "cuda":
            return
        event = torch.cuda.Event()
        event.record()
        started = time.perf_counter()
        while not event.query():
            self.check_deadline(started, what, patience)
            time.sleep(0.0002)

    def close(self) -> None:
        """Stop the helper threads: the waiters and the board's store helper (a later wait starts new ones)."""
        self._waiters.close()
        self.board.close()


_setup_guards = 0


def setup_guard(timeout: float, store: Any = None) -> Guard:
    """A guard for a collective made before a pipeline exists (the profile handed round, say).

    Its board is one of its own - named by a count every rank advances alike, as all build their pipelines in
    the same order - and, as every board, it watches the run's job key, where a process that dies of an
    exception posts it. Close it after use (:meth:`Guard.close`).
    """
    global _setup_guards
    _setup_guards += 1
    return Guard(f"setup/{_setup_guards - 1}", timeout, f"global rank {dist.get_rank()}", store=store)
