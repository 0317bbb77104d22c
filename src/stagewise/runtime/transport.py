"""Transport: the pipeline's only door to torch.distributed (with :mod:`.init`).

Point-to-point goes to explicit group ranks, mapped to global ranks with
``dist.get_global_rank`` (the pipeline group is never assumed to be WORLD).
Every message has its own tag (pipeline, direction, stage, micro-batch), so
gloo matches messages by name rather than by posting order, and a step
abandoned after an error cannot feed another pipeline.

Two ways to post:

* *batched* - a run of the schedule's communication actions at once. On
  NCCL that is one ``batch_isend_irecv`` group, as the schedule validator
  assumes (a send and a receive between two ranks must be in flight together
  or both GPUs wait forever); on gloo plain ``isend``/``irecv``.
* *eager* - one op at a time, on gloo: for values whose shapes are not known
  yet (see :mod:`.messages`). On NCCL these go over a gloo side group on CPU,
  because a receive posted late in its own group could deadlock the stream.

No rank hangs when another fails: failures are written to an *error board* in
the process group's c10d store, and every blocking wait watches the board and
a deadline. A gloo wait blocks its thread and cannot be interrupted (a wait
with a timeout closes the connection, and gloo's work objects cannot be
polled: they report completion only once waited on), so it runs on a helper
thread while the caller watches; NCCL waits only order streams, and a step
ends by polling a CUDA event.

Handing a wait to a helper costs two thread wake-ups (hundreds of microseconds
on a busy CPU), so the caller can :meth:`Transport.watch` a receive it will
need next: a helper waits for it in the background, and the later
:meth:`Transport.wait` returns at once if it has arrived. Sends whose value the
peer has already used (:meth:`Transport.release`) are complete, so they are
waited on directly.
"""

from __future__ import annotations

import atexit
import gc
import logging
import queue
import threading
import time
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .errors import PipelineError

log = logging.getLogger(__name__)

_ERROR_KEY = "error"
_POLL_S = 0.05  # how often a long wait looks at the error board
_TAG_BITS = 20  # tags: pipeline id (10 bits) | message tag (20 bits)

#: backends whose point-to-point must be posted in schedule batches (tests may add "gloo")
GROUPED_BACKENDS = {"nccl"}

_pipelines_made: dict[str, int] = {}
_at_exit: weakref.WeakSet[Any] = weakref.WeakSet()  # released at exit, see _close_all


@dataclass
class Op:
    """One tensor to send to / receive from group rank ``peer``, under a per-message ``tag``."""

    peer: int
    tensor: torch.Tensor
    send: bool
    tag: int = 0
    key: Any = None  # what the op belongs to, for the caller


def require_initialized() -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialised: call stagewise.init() (or torch.distributed.init_process_group) "
            "before building a Pipeline"
        )


def group_or_world(group: Any) -> Any:
    return dist.group.WORLD if group is None else group


def group_rank(group: Any) -> int:
    return dist.get_rank(group)


def group_size(group: Any) -> int:
    return dist.get_world_size(group)


def backend_of(group: Any) -> str:
    return str(dist.get_backend(group))


def default_store() -> Any:
    """The store the default process group was rendezvoused with (torchrun's, or init's)."""
    get = getattr(dist.distributed_c10d, "_get_default_store", None)
    if get is None:
        raise RuntimeError("this torch version does not expose the default store; pass store= to the Pipeline")
    return get()


def next_pipeline_id(group: Any) -> tuple[str, int]:
    """A name and a tag every rank derives alike, as long as all build their pipelines in the same order."""
    base = getattr(group, "group_name", None) or "group"
    count = _pipelines_made.get(base, 0)
    _pipelines_made[base] = count + 1
    return f"{base}/{count}", count


def gather_objects(obj: Any, group: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def side_group(group: Any) -> Any:
    """A gloo group with the members of ``group``, for eager point-to-point next to a grouped backend.

    ``dist.new_group`` must be called by every process in the same order, and
    each process only knows its own pipeline group, so the groups are gathered
    first: a collective over the default group, as every rank builds its
    Pipeline at the same time.
    """
    if backend_of(group) not in GROUPED_BACKENDS:
        return None
    mine = tuple(dist.get_global_rank(group, r) for r in range(dist.get_world_size(group)))
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    found = None
    for ranks in sorted(set(everyone)):
        made = dist.new_group(list(ranks), backend="gloo")
        if ranks == mine:
            found = made
    return found


class Transport:
    """Point-to-point, the error board and deadline-aware waits for one pipeline on one group."""

    def __init__(
        self,
        group: Any,
        *,
        name: str,
        pipeline_id: int,
        timeout: float,
        store: Any = None,
        side: Any = None,
        board: str | None = None,
        label: str | None = None,
    ) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.me = label or f"rank {self.rank}"  # how failure messages name this rank
        self.size = dist.get_world_size(group)
        self._global = [dist.get_global_rank(group, r) for r in range(self.size)]
        self.grouped = backend_of(group) in GROUPED_BACKENDS
        self._stream_waits = backend_of(group) == "nccl"  # a wait orders streams, the CPU goes on
        self._eager_group = group if side is None else side
        self._tag_base = (pipeline_id % 1024) << _TAG_BITS
        self.timeout = timeout
        board = name if board is None else board  # pipelines sharing a board see each other's failures
        self.store = dist.PrefixStore(f"stagewise/{board}/", default_store() if store is None else store)
        self.failure: str | None = None
        self.waiting = ""
        self._sends: dict[int, Any] = {}  # id -> work, until finished or released
        self._eager_sends: list[Any] = []
        self._waiters: list[_Waiter] = []

    @staticmethod
    def check_tag(tag: int) -> None:
        if not 0 <= tag < 1 << _TAG_BITS:
            raise ValueError(f"message tag {tag} does not fit in {_TAG_BITS} bits: too many stages x micro-batches")

    # ---- the error board ----------------------------------------------
    def fail(self, message: str) -> str:
        """Post ``message`` unless another rank's failure came first; returns the failure that stands."""
        try:
            stood = self.store.compare_set(_ERROR_KEY, "", message)
            self.failure = stood.decode() if isinstance(stood, bytes) else str(stood)
        except Exception as err:  # the store itself is gone: keep the local message
            log.warning("stagewise: could not post the failure to the store: %s", err)
            self.failure = message
        return self.failure

    def check(self) -> None:
        """Raise :class:`PipelineError` if any rank has posted a failure."""
        if self.failure is None and self.store.check([_ERROR_KEY]):
            self.failure = self.store.get(_ERROR_KEY).decode()
        if self.failure is not None:
            raise PipelineError(self.failure)

    def _watch(self, started: float, what: str) -> None:
        self.check()
        waited = time.perf_counter() - started
        if waited > self.timeout:
            raise PipelineError(
                self.fail(
                    f"{self.me} waited {waited:.1f} s for {what}; is another rank stuck or dead? "
                    f"(timeout={self.timeout:g} s)"
                )
            )

    # ---- point-to-point ------------------------------------------------
    def post(self, ops: Sequence[Op]) -> list[list[Any]]:
        """Post one schedule batch; returns, per op, the works that complete it.

        On NCCL the batch is one group whose works complete all of it, so every
        op gets them all; on gloo each op has its own. Sends are also kept for
        :meth:`finish_sends`.
        """
        if self.failure is not None:
            raise PipelineError(self.failure)
        if not ops:
            return []
        if not self.grouped:
            works = self._post_each(ops, self.group)
            self._keep(w for w, op in zip(works, ops) if op.send)
            return [[w] for w in works]
        p2p = [
            dist.P2POp(dist.isend if op.send else dist.irecv, op.tensor, g, self.group, self._tag_base + op.tag)
            for op, g in zip(ops, (self._global[op.peer] for op in ops))
        ]
        works = [w for w in dist.batch_isend_irecv(p2p) if w is not None]
        if len(works) == len(ops):  # a backend that does not coalesce: one work per op
            self._keep(w for w, op in zip(works, ops) if op.send)
            return [[w] for w in works]
        if any(op.send for op in ops):
            self._keep(works)
        return [works for _ in ops]

    def _keep(self, works: Iterable[Any]) -> None:
        self._sends.update((id(w), w) for w in works)

    def warm_up(self) -> None:
        """On NCCL, the first call in a group must involve all its ranks: make it a collective, here."""
        if self._stream_waits:
            dist.all_reduce(torch.zeros(1, device="cuda"), group=self.group)

    def post_eager(self, ops: Sequence[Op]) -> list[Any]:
        """Post ops one by one on gloo (the side group next to NCCL); tensors must live where gloo can read."""
        if self.failure is not None:
            raise PipelineError(self.failure)
        works = self._post_each(ops, self._eager_group)
        self._eager_sends.extend(w for w, op in zip(works, ops) if op.send)
        return works

    def _post_each(self, ops: Sequence[Op], group: Any) -> list[Any]:
        return [
            (dist.isend if op.send else dist.irecv)(op.tensor, self._global[op.peer], group, self._tag_base + op.tag)
            for op in ops
        ]

    def watch(self, works: Sequence[Any]) -> Watch | None:
        """Start waiting for ``works`` on a helper thread; pass the result to :meth:`wait` (None: nothing to watch)."""
        if not works or self.failure is not None or self._stream_waits:
            return None
        return self._submit(works)

    def wait(self, works: Sequence[Any], what: str, *, eager: bool = False, watch: Watch | None = None) -> None:
        """Block until ``works`` complete, raising :class:`PipelineError` on any rank's failure or the deadline.

        ``watch``: what :meth:`watch` returned for these works, if it was called.
        """
        if not works:
            return
        self.waiting = what  # the last thing waited for, named in the hang report (see .forensics)
        if self.failure is not None:
            raise PipelineError(self.failure)
        if self._stream_waits and not eager:
            for w in works:
                w.wait()
            return
        job = self._submit(works) if watch is None else watch
        if not job.event.is_set():
            started = time.perf_counter()
            while not job.event.wait(_POLL_S):
                try:
                    self._watch(started, what)
                except PipelineError:
                    if job.waiter in self._waiters:  # its thread is stuck in gloo; leave it behind
                        self._waiters.remove(job.waiter)
                    raise
        if job.error is not None:
            raise PipelineError(self.fail(f"{self.me}: {what} failed: {job.error}")) from job.error

    def _submit(self, works: Sequence[Any]) -> Watch:
        """Give ``works`` to an idle helper (one that has finished all it was given), or to a new one."""
        for waiter in self._waiters:
            if waiter.idle:
                return waiter.submit(works)
        waiter = _Waiter()
        self._waiters.append(waiter)
        return waiter.submit(works)

    def release(self, works: Sequence[Any], what: str) -> None:
        """Wait for sends known to be done (their value was used) so their buffers are freed before the step ends.

        The peer has used the value, so each send has completed or is about to (its I/O thread marks it done):
        a direct wait cannot block for long, and skips the helper's two wake-ups.
        """
        mine = [self._sends.pop(id(w)) for w in works if id(w) in self._sends]
        if self._stream_waits:
            self.wait(mine, what)
            return
        try:
            for w in mine:
                w.wait()
        except Exception as err:
            raise PipelineError(self.fail(f"{self.me}: {what} failed: {err}")) from err

    def finish_sends(self) -> None:
        """Wait for every send posted so far: after this their buffers may be freed."""
        sends, self._sends = list(self._sends.values()), {}
        self.wait(sends, "its sends to complete")
        sends, self._eager_sends = self._eager_sends, []
        self.wait(sends, "its sends to complete", eager=True)

    def synchronize(self, device: torch.device) -> None:
        """On CUDA, wait for queued kernels and transfers while watching the error board."""
        if device.type != "cuda":
            return
        event = torch.cuda.Event()
        event.record()
        started = time.perf_counter()
        while not event.query():
            self._watch(started, "the GPU to finish the step")
            time.sleep(0.0002)

    def drop_groups(self) -> None:
        """Stop the helpers and forget the process groups, so that they can be destroyed (the pipeline is done).

        After a failure the groups are kept: a collective may still be stuck in
        them, and destroying a gloo group waits for its collectives.
        """
        self.close()
        if self.failure is None:
            self.group = self._eager_group = None
            self._sends, self._eager_sends = {}, []

    def close(self, join_s: float = 1.0) -> None:
        """Stop the helper threads and join the idle ones (a helper stuck in gloo after a failure is left)."""
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            waiter.stop()
        deadline = time.perf_counter() + join_s
        for waiter in waiters:
            if waiter.idle:
                waiter.join(max(0.0, deadline - time.perf_counter()))


@atexit.register
def _close_all() -> None:
    """Before the interpreter shuts down: join the helper threads and let the process groups go.

    Two ways a rank that trained fine can abort at exit ("terminate called
    without an active exception"): a daemon thread that returns from a gloo
    wait while Python finalises is ended inside torch's C++ frames; and a gloo
    process group destroyed during finalisation (a Pipeline still holding it
    after ``destroy_process_group()``) has worker threads that may drop the
    last reference to a Python-owned tensor, which needs the interpreter.
    Exit handlers run while Python is whole: unreferenced pipelines are
    collected here, and live ones drop their references to process groups.
    """
    gc.collect()
    for owner in list(_at_exit):
        try:
            owner.release_at_exit()
        except Exception as err:  # an exit handler must not stop the others
            log.warning("stagewise: releasing %r at exit failed: %s", type(owner).__name__, err)
    gc.collect()


def release_at_exit(owner: Any) -> None:
    """Have ``owner.release_at_exit()`` run at interpreter exit, if ``owner`` is still alive then."""
    _at_exit.add(owner)


@dataclass
class Watch:
    """Works a helper thread is waiting for: ``event`` is set once they completed (or failed, with ``error``)."""

    works: Sequence[Any]
    waiter: _Waiter
    event: threading.Event
    error: BaseException | None = None


class _Waiter:
    """A daemon thread that runs blocking gloo waits, one job at a time, on the caller's behalf."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Watch | None] = queue.SimpleQueue()
        self._last: Watch | None = None
        self._thread = threading.Thread(target=self._run, name="stagewise-wait", daemon=True)
        self._thread.start()

    @property
    def idle(self) -> bool:
        """True when every job given so far has finished."""
        return self._last is None or self._last.event.is_set()

    def submit(self, works: Sequence[Any]) -> Watch:
        job = Watch(works, self, threading.Event())
        self._last = job
        self._jobs.put(job)
        return job

    def stop(self) -> None:
        self._jobs.put(None)

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                for w in job.works:
                    w.wait()
            except BaseException as err:  # reported to the caller, who raises it
                job.error = err
            job.event.set()
