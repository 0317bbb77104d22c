"""The coordinator: the c10d store every rank reaches, and the run's own corner of it.

Two things make the store safe to lean on when a rank is in trouble:

* **Run scope.** Every key stagewise writes lives under ``stagewise/<run>/``,
  where ``<run>`` names this job and attempt, so a job on a store that outlived
  a failed one (torchrun's agent store across ``--max-restarts``, or
  ``Pipeline(store=...)`` reused) never reads the previous job's failure.
  Under torchrun it is ``TORCHELASTIC_RUN_ID`` and
  ``TORCHELASTIC_RESTART_COUNT`` (no communication needed). Without them
  the ranks agree on a random nonce once, broadcast from global rank 0: in
  :func:`stagewise.init` right after the process group exists, or - for
  users who initialise ``torch.distributed`` themselves - lazily when the
  first error board is made (every rank of the world builds its first
  Pipeline at the same time, SPMD), bounded by the pipeline's timeout.
* **A client of its own, with a deadline.** The store is hosted by one process
  (rank 0 under torchrun). If that process is stopped, every store call on
  the shared client would block for the process group's timeout (minutes),
  and a stuck call would hold the client's lock for everyone. The error
  board therefore talks to the store over its own connection whose every call
  times out after the pipeline's ``timeout``; a call that fails or times out
  means the coordinator is unreachable, and is reported as such
  (:data:`UNREACHABLE`) rather than as a raw socket error.
"""

from __future__ import annotations

import os
import secrets
import threading
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..errors import PipelineError

UNREACHABLE = "the coordinator (store host, rank 0) is unreachable"

_scope: str | None = None
_clients: dict[tuple[str, int, float], Any] = {}


def torchrun_scope() -> str | None:
    """``<run id>/attempt<k>`` from torchrun's environment, or None outside torchrun."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if not run_id:
        return None
    return f"{run_id}/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def agree_run_scope(timeout: float | None = None) -> str:
    """The run's scope, agreed once per process (see the module docstring); a collective over the world
    the first time when torchrun's variables are absent. ``timeout`` bounds that broadcast (None: the backend's)."""
    global _scope
    if _scope is not None:
        return _scope
    scope = torchrun_scope()
    if scope is None:
        scope = f"run-{_broadcast_nonce(timeout)}"
    _scope = scope
    return scope


def reset_run_scope() -> None:
    """Forget the scope (after ``destroy_process_group``, a new group may be a new run)."""
    global _scope
    _scope = None


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


def call_with_deadline(fn: Any, timeout: float, what: str, me: str | None = None) -> Any:
    """``fn()`` on a helper thread; :class:`PipelineError` if it has not returned within ``timeout`` seconds.

    For blocking calls that cannot be made asynchronous (process-group creation, a store rendezvous): the
    helper is left behind if it never returns (a daemon; its thread ends with the process).
    """
    box: dict[str, Any] = {}
    done = threading.Event()

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as err:  # handed to the caller
            box["error"] = err
        done.set()

    threading.Thread(target=run, name="stagewise-call", daemon=True).start()
    if not done.wait(timeout):
        who = me or f"rank {dist.get_rank() if dist.is_initialized() else '?'}"
        raise PipelineError(
            f"{who} waited {timeout:g} s for {what}; is another rank stuck or dead? (timeout={timeout:g} s)"
        )
    if "error" in box:
        raise box["error"]
    return box.get("value")


def tcp_store_of(store: Any) -> Any:
    """The TCPStore under ``store``'s prefixes, or None (a HashStore, a FileStore: no host to lose)."""
    seen = 0
    while isinstance(store, dist.PrefixStore) and seen < 16:
        store = store.underlying_store
        seen += 1
    return store if isinstance(store, dist.TCPStore) else None


def board_client(store: Any, timeout: float) -> Any:
    """A store for the run's keys (prefixed ``stagewise/<run>/``): a connection of its own, whose calls time out
    after ``timeout`` seconds, to the host of ``store`` (the default group's when None)."""
    if store is None:
        store = _default_store()
    base = store
    tcp = tcp_store_of(store)
    if tcp is not None:
        key = (tcp.host, tcp.port, float(timeout))
        base = _clients.get(key)
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
            _clients[key] = base
    return dist.PrefixStore(f"stagewise/{agree_run_scope(timeout)}/", base)


def _default_store() -> Any:
    get = getattr(dist.distributed_c10d, "_get_default_store", None)
    if get is None:
        raise RuntimeError("this torch version does not expose the default store; pass store= to the Pipeline")
    return get()
