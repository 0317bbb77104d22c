"""The coordinator: the c10d store every rank reaches, and the run's own corner of it.

Two things make the store safe to lean on when a rank is in trouble:

* **Run scope.** Every key stagewise writes lives under ``stagewise/<run>/``,
  where ``<run>`` names this job and attempt *and a nonce drawn for this job*,
  so a job on a store that outlived a failed one (torchrun's agent store
  across ``--max-restarts``, a rendezvous store that outlives its jobs, or
  ``Pipeline(store=...)`` reused) never reads the previous job's failure -
  not even when it reuses the run id (``--rdzv-id``). Under torchrun ``<run>``
  is ``TORCHELASTIC_RUN_ID/<nonce>``, else ``run-<nonce>``: not the restart
  count, which each machine's agent keeps for itself - an agent counts a
  restart its own workers' failure caused, not one a change of membership
  caused (``--nnodes MIN:MAX``), so after a machine is lost the workers of one
  round can hold different counts. The nonce is global rank 0's, agreed once: through the
  store before the process group exists when its rendezvous goes through that
  store (:mod:`.attempt_store`, whose keys must be fresh too), else by a
  broadcast right after it exists - in :func:`stagewise.init`, or, for users
  who initialise ``torch.distributed`` themselves, lazily when the first error
  board is made (every rank of the world builds its first Pipeline at the
  same time, SPMD), bounded by the pipeline's timeout.
* **A client of its own, with a deadline.** The store is hosted by one process
  (rank 0 under torchrun). If that process is stopped, every store call on
  the shared client would block - a TCPStore client's timeout bounds waiting
  for keys, not a silent host - and a stuck call would hold the client's lock
  for everyone. The error board therefore talks to the store over its own
  connection, each call made on a helper thread that must answer within the
  pipeline's ``timeout`` (:class:`DeadlineStore`); a call that fails or times out
  means the coordinator is unreachable, and is reported as such
  (:data:`UNREACHABLE`) rather than as a raw socket error.
"""

from __future__ import annotations

import os
import queue
import secrets
import threading
import time
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..errors import PipelineError
from .blocking import inside

UNREACHABLE = "the coordinator (store host, rank 0) is unreachable"
_WATCH_S = 0.25  # how often a bounded call looks for a failure posted for the job

_scope: str | None = None
_nonce: str | None = None  # agreed through the store before the process group existed (see .attempt_store)
_clients: dict[tuple[str, int, float], Any] = {}


def torchrun_scope() -> str | None:
    """The run id from torchrun's environment (alike on every worker of every round), or None outside torchrun."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    return run_id or None


def agree_run_scope(timeout: float | None = None) -> str:
    """The run's scope, agreed once per process (see the module docstring); a collective over the world
    the first time unless the nonce was agreed through the store. ``timeout`` bounds the broadcast (None: the
    backend's)."""
    global _scope
    if _scope is not None:
        return _scope
    nonce = _nonce if _nonce is not None else _broadcast_nonce(timeout)
    base = torchrun_scope()
    _scope = f"{base}/{nonce}" if base is not None else f"run-{nonce}"
    return _scope


def adopt_nonce(nonce: str) -> None:
    """Global rank 0's nonce, agreed through the store before the process group existed (:mod:`.attempt_store`)."""
    global _nonce, _scope
    _nonce, _scope = nonce, None


def _broadcast_nonce(timeout: float | None) -> str:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return secrets.token_hex(8)
    device = "cuda" if str(dist.get_backend()) == "nccl" else "cpu"
    mine = int.from_bytes(secrets.token_bytes(7), "little")
    buf = torch.tensor([mine], dtype=torch.int64, device=device)
    work = dist.broadcast(buf, src=0, async_op=True)
    if timeout is None:
        work.wait()
    else:
        call_with_deadline(work.wait, timeout, "the run id from global rank 0")
    return f"{int(buf.item()):014x}"


def start_call(fn: Any) -> tuple[threading.Event, dict[str, Any]]:
    """Start ``fn()`` on a daemon helper thread: the event is set when it returned, with ``box["value"]`` or
    ``box["error"]`` (a helper that never returns is left behind; it ends with the process)."""
    box: dict[str, Any] = {}
    done = threading.Event()

    def run() -> None:
        try:
            with inside():  # (see .blocking: not in torch at interpreter exit)
                box["value"] = fn()
        except BaseException as err:  # handed to the caller
            box["error"] = err
        done.set()

    threading.Thread(target=run, name="stagewise-call", daemon=True).start()
    return done, box


#: (job_failure, blame) once the heartbeat runs: a bounded call stops at a failure posted for the job and, when
#: its deadline passes, names the ranks that stopped showing signs of life (see .faults.heartbeat)
_watch: tuple[Callable[[], str | None], Callable[[float], str]] | None = None


def watch_calls(job_failure: Callable[[], str | None], blame: Callable[[float], str]) -> None:
    """Have :func:`call_with_deadline` watch ``job_failure()`` (a posted failure, or None) while it waits, and
    lead its deadline message with ``blame(timeout)`` (the silent ranks, or "")."""
    global _watch
    _watch = (job_failure, blame)


def call_with_deadline(fn: Any, timeout: float, what: str, me: str | None = None) -> Any:
    """``fn()`` on a helper thread; :class:`PipelineError` if it has not returned within ``timeout`` seconds, or
    at once if a process of the job posted a failure meanwhile (once the heartbeat runs: :func:`watch_calls`).

    For blocking calls that cannot be made asynchronous (process-group creation, a store rendezvous, the link
    probes' collectives): the helper is left behind if it never returns (a daemon; it ends with the process).
    """
    done, box = start_call(fn)
    started = time.monotonic()
    who = me or f"rank {dist.get_rank() if dist.is_initialized() else '?'}"
    while not done.wait(min(_WATCH_S, max(timeout - (time.monotonic() - started), 0.0))):
        if time.monotonic() - started >= timeout:
            culprit = _watch[1](timeout) if _watch is not None else ""
            head = f"{culprit}: " if culprit else ""
            tail = "" if culprit else "; is another rank stuck or dead?"
            raise PipelineError(f"{head}{who} waited {timeout:g} s for {what}{tail} (timeout={timeout:g} s)")
        if _watch is not None:
            try:
                posted = _watch[0]()
            except Exception as err:
                raise PipelineError(f"{UNREACHABLE} (seen by {who}, waiting for {what}): {err}") from err
            if posted is not None:
                raise PipelineError(posted)
    if "error" in box:
        raise box["error"]
    return box.get("value")


class Posted:
    """A store call handed to a :class:`DeadlineStore`'s helper (:meth:`DeadlineStore.post`): ``done`` is set when
    it returned, ``started`` is when it was posted (``time.perf_counter``)."""

    def __init__(self, started: float) -> None:
        self.started = started
        self.box: dict[str, Any] = {}
        self.done = threading.Event()

    def result(self) -> Any:
        """What the call returned, or its exception raised (only once :attr:`done` is set)."""
        if "error" in self.box:
            raise self.box["error"]
        return self.box.get("value")


class DeadlineStore:
    """A store whose every call runs on one helper thread and must return within ``timeout`` seconds.

    A TCPStore client's calls block on the socket without a deadline when the
    host is stopped (its ``timeout`` bounds waiting for keys, not the host's
    reply), and a stuck call holds the client for every later one. Here a call
    that does not return in time - or that finds the helper still stuck in an
    earlier one - raises :class:`TimeoutError`: the coordinator is unreachable.
    """

    def __init__(self, store: Any, timeout: float) -> None:
        self.store = store
        self.timeout = timeout
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()  # calls; None: the store was collected
        self._stuck = False  # a call did not return in time: the helper may never come back
        self._helper: threading.Thread | None = None

    def _call(self, name: str, *args: Any) -> Any:
        with self._lock:
            posted = self._post(lambda store: getattr(store, name)(*args))
            if not posted.done.wait(self.timeout):
                self._stuck = True
                raise TimeoutError(f"the store did not answer {name}() within {self.timeout:g} s")
            return posted.result()

    def post(self, fn: Callable[[Any], Any]) -> Posted:
        """``fn(store)`` on the helper thread, not waited for: a caller that must not block on a round trip to the
        store host (a wait polling the board while its works may complete any moment) reads it when done."""
        with self._lock:
            return self._post(fn)

    def _post(self, fn: Callable[[Any], Any]) -> Posted:
        if self._stuck:
            raise TimeoutError(f"an earlier store call has not returned after {self.timeout:g} s")
        if self._helper is None:  # holds the queue and the store, not self: collected, self ends it
            self._helper = threading.Thread(
                target=_serve, args=(self._jobs, self.store), name="stagewise-store", daemon=True
            )
            self._helper.start()
            weakref.finalize(self, self._jobs.put, None)
        posted = Posted(time.perf_counter())
        self._jobs.put((fn, posted.box, posted.done))
        return posted

    def stuck(self) -> None:
        """A posted call did not return in time: every later call is refused at once, as after a sync one's."""
        self._stuck = True

    def close(self, join_s: float = 2.0) -> None:
        """End the helper thread, so that a board let go leaves none behind (a later call starts another): it is
        joined, for ``join_s`` seconds at most, so that a count of threads after ``close`` does not find it still
        ending; one stuck in a call is left to end with the process (a daemon)."""
        with self._lock:
            helper, self._helper = self._helper, None
            if helper is None or self._stuck:
                return
            self._jobs.put((None, {}, threading.Event()))
        if helper is not threading.current_thread():
            helper.join(join_s)

    def check(self, keys: list[str]) -> bool:
        return bool(self._call("check", keys))

    def get(self, key: str) -> bytes:
        return self._call("get", key)

    def set(self, key: str, value: str) -> None:
        self._call("set", key, value)

    def add(self, key: str, amount: int) -> int:
        return int(self._call("add", key, amount))

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        return self._call("compare_set", key, expected, desired)


def _serve(jobs: queue.SimpleQueue[Any], store: Any) -> None:
    """A :class:`DeadlineStore`'s helper: its calls, one at a time, until the store is collected (None)."""
    while True:
        job = jobs.get()
        if job is None or job[0] is None:  # the store was collected, or closed (DeadlineStore.close)
            return
        fn, box, done = job
        try:
            with inside():  # (see .blocking: not in torch at interpreter exit)
                box["value"] = fn(store)
        except BaseException as err:  # handed to the caller
            box["error"] = err
        done.set()


def tcp_store_of(store: Any) -> Any:
    """The TCPStore under ``store``'s prefixes, or None (a HashStore, a FileStore: no host to lose)."""
    seen = 0
    while isinstance(store, dist.PrefixStore) and seen < 16:
        store = store.underlying_store
        seen += 1
    return store if isinstance(store, dist.TCPStore) else None


def board_client(store: Any, timeout: float, own: bool = False, cached: bool = False) -> Any:
    """A store for the run's keys (prefixed ``stagewise/<run>/``): a connection of its own, whose calls time out
    after ``timeout`` seconds, to the host of ``store`` (the default group's when None); shared by the boards
    with the same timeout, or (``own``) for one user alone, such as a helper thread; ``cached``: any connection
    already open to that host will do (leaving: no time to open one)."""
    if store is None:
        store = _default_store()
    base = store
    tcp = tcp_store_of(store)
    if tcp is not None:
        key = (tcp.host, tcp.port, float(timeout))
        base = None if own else _clients.get(key)
        if cached and base is None:
            base = next((c for (h, p, _), c in _clients.items() if (h, p) == (tcp.host, tcp.port)), None)
        if base is None:
            try:
                base = call_with_deadline(
                    lambda: dist.TCPStore(
                        tcp.host, tcp.port, is_master=False, timeout=timedelta(seconds=timeout), wait_for_workers=False
                    ),
                    timeout,
                    f"a connection to the store at {tcp.host}:{tcp.port}",
                )
            except Exception as err:
                raise PipelineError(f"{UNREACHABLE} (at {tcp.host}:{tcp.port}): {err}") from err
            if not own:
                _clients[key] = base
    return DeadlineStore(dist.PrefixStore(f"stagewise/{agree_run_scope(timeout)}/", base), timeout)


def _default_store() -> Any:
    get = getattr(dist.distributed_c10d, "_get_default_store", None)
    if get is None:
        raise RuntimeError("this torch version does not expose the default store; pass store= to the Pipeline")
    return get()
