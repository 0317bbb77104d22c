"""A failed generation's pipeline let go off the recovery path: its gloo groups dropped there, destroyed later.

gloo has no abort: a group's destructor joins its worker threads, and one of them may sit in an op on a peer
that was stopped or cut off until the group's timeout. Left to the garbage collector, that destructor runs on
whichever thread the collection happens on - the training loop's, in the survivors' next step - and stalls
it. So the recovery path hands the failed pipeline to :func:`hold`: it stays referenced (tensors included,
for whoever restores from them) until ``after_s`` have passed, by when such an op has timed out, and is then
collected on this module's one daemon thread. The recovery path itself runs no collection: a full one walks
the whole heap (0.2 s of CPU measured, seconds of wall time on a loaded machine) and found nothing to free,
as the failure's traceback still holds the pipeline then.
"""

from __future__ import annotations

import atexit
import gc
import threading
import time
from typing import Any

from . import lifecycle  # noqa: F401  (its exit handler is registered first, so it runs after ours)

_held: list[tuple[float, Any]] = []
_cond = threading.Condition()
_thread: threading.Thread | None = None


def hold(obj: Any, after_s: float) -> None:
    """Keep ``obj`` referenced for ``after_s`` seconds, then drop it and collect, on the release thread."""
    global _thread
    with _cond:
        _held.append((time.monotonic() + after_s, obj))
        if _thread is None:
            _thread = threading.Thread(target=_run, name="stagewise-release", daemon=True)
            _thread.start()
        _cond.notify()


def held() -> int:
    """How many objects are held now."""
    with _cond:
        return len(_held)


def _run() -> None:
    while True:
        with _cond:
            while not _held or _first() > time.monotonic():
                _cond.wait(None if not _held else max(0.0, _first() - time.monotonic()))
            now = time.monotonic()
            due = [obj for at, obj in _held if at <= now]
            _held[:] = [(at, obj) for at, obj in _held if at > now]
        del due  # the last references, here
        gc.collect()


def _first() -> float:
    return min(at for at, _ in _held)


@atexit.register
def _let_go() -> None:
    """At exit, drop what is held while Python is whole (:mod:`.lifecycle`'s handler then collects it)."""
    with _cond:
        _held.clear()
