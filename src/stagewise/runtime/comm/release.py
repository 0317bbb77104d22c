"""A failed generation's process groups let go off the recovery path: dropped there, destroyed later.

gloo has no abort: a group's destructor joins its worker threads, and one of them may sit in an op on a peer
that was stopped or cut off until the group's timeout. Destroyed where its last reference goes - the recovery
path, or the training loop's next collection - it would stall it. So the recovery path hands the groups (and
their stores) to :func:`hold`: they stay referenced until ``after_s`` have passed, by when such an op has timed
out, and are then let go on this module's one daemon thread. Only the groups are held, never the pipeline: its
tensors (parameters, optimizer state, activations, snapshot buffers) go at once (``relayout.let_go``); holding
it would keep a second copy of the state alive for the whole timeout.

At interpreter exit (:func:`_let_go`) the thread is stopped and joined while Python is whole, and what it still
holds is let go on the main thread: a daemon thread destroying a group as the interpreter finalizes could be
ended inside torch's C++ frames (an abort, "terminate called without an active exception").
"""

from __future__ import annotations

import atexit
import threading
import time
from typing import Any

import torch.distributed as dist

from . import lifecycle  # noqa: F401  (its exit handler is registered first, so it runs after ours)

_held: list[tuple[float, Any]] = []
_cond = threading.Condition()
_thread: threading.Thread | None = None
_stopping = False
_busy = False  # the thread is letting something go (outside the lock)


def groups_now() -> list[tuple[Any, Any]]:
    """Every process group this process has now, with its store: what a failed generation must not destroy on
    the recovery path (the default group and every group made in it)."""
    return list(dist.distributed_c10d._world.pg_map.items()) if dist.is_initialized() else []


def hold(obj: Any, after_s: float) -> None:
    """Keep ``obj`` referenced for ``after_s`` seconds, then let it go on the release thread."""
    global _thread
    with _cond:
        _held.append((time.monotonic() + after_s, obj))
        if _thread is None and not _stopping:
            _thread = threading.Thread(target=_run, name="stagewise-release", daemon=True)
            _thread.start()
        _cond.notify()


def held() -> int:
    """How many objects are held now."""
    with _cond:
        return len(_held)


def _run() -> None:
    global _busy
    while True:
        with _cond:
            while not _stopping and (not _held or _first() > time.monotonic()):
                _cond.wait(None if not _held else max(0.0, _first() - time.monotonic()))
            if _stopping:
                return
            now = time.monotonic()
            due = [obj for at, obj in _held if at <= now]
            _held[:] = [(at, obj) for at, obj in _held if at > now]
            _busy = True
        del due  # the last references, here: a group's destructor runs on this thread
        with _cond:
            _busy = False
            _cond.notify_all()


def _first() -> float:
    return min(at for at, _ in _held)


@atexit.register
def _let_go() -> None:
    """At exit: the thread stops (a group it is destroying is finished first), then what is held goes here, on the
    main thread while Python is whole (:mod:`.lifecycle`'s handler then collects what it leaves)."""
    global _stopping
    with _cond:
        _stopping = True
        _cond.notify_all()
        _cond.wait_for(lambda: not _busy, timeout=60.0)  # (bounded: a destructor waits a group's timeout at most)
        left = [obj for _, obj in _held]
        _held.clear()
    thread = _thread
    if thread is not None:
        thread.join(5.0)
    del left
