"""Helper threads inside a blocking torch call, counted for the whole process: none may be left at exit.

stagewise makes calls that cannot be interrupted on helper threads (gloo waits, store calls, a group's
creation), so that the caller can watch the error board and the clock. After a failure such a thread can stay
in torch, waiting on a peer that failed. If it returns while the interpreter finalizes - the peer's exit closes
the connection - Python ends the thread inside torch's C++ frames and the process aborts ("terminate called
without an active exception", SIGABRT). So each such call runs :func:`inside`, and the exit path
(:mod:`.lifecycle`, with :func:`.faults.exit_hook.at_exit`) lets the interpreter finalize only once
:func:`settle` says none is left.

gloo's own threads abort the same way. A collective's work is run by a worker thread of its group, which drops
its references to the work (and so to its tensors) only after the waiter has returned; the drop that leaves a
tensor to Python alone takes the interpreter's lock (torch keeps a tensor's Python object alive while C++ holds
it). When that comes as the interpreter finalizes, CPython ends the worker inside the work's destructor, and the
process aborts. A snapshot group's workers run in a core's idle time (:mod:`..elastic.idle`): on a loaded
machine the drop can come many milliseconds after the wait, when the job has already returned and is exiting
(the last snapshot's commit, 2026-12-05: 1 abort in 14 in-place jobs). So a collective a thread waits for right
before it ends runs :func:`letting_go`: the thread ends only once the worker let go of the tensor.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_changed = threading.Condition()
_inside = 0
_LET_GO_POLL_S = 0.001  # how often :func:`letting_go` looks again (each look lets go of the interpreter's lock)


@contextmanager
def inside() -> Iterator[None]:
    """Around a blocking torch call made on a helper thread."""
    global _inside
    with _changed:
        _inside += 1
    try:
        yield
    finally:
        with _changed:
            _inside -= 1
            _changed.notify_all()


def settle(timeout: float) -> bool:
    """Wait up to ``timeout`` seconds until no helper thread is inside a blocking torch call; True if none is."""
    with _changed:
        return _changed.wait_for(lambda: _inside == 0, max(0.0, timeout))


def count() -> int:
    """How many helper threads are inside a blocking torch call now."""
    return _inside


@contextmanager
def letting_go(tensor: Any, timeout: float) -> Iterator[None]:
    """Around a collective on ``tensor`` whose work the block waits for and drops: at its end, wait until torch's
    threads hold no more references to ``tensor`` than before it (the worker that ran the work has dropped it, and
    with it the tensor's Python object: see the module docstring) - at most until ``timeout`` seconds after the
    block began. Not after an error (the worker may still be in the collective). Where torch cannot count
    references, it waits for nothing."""
    end = time.monotonic() + max(0.0, timeout)
    uses = getattr(tensor, "_use_count", None)  # torch's (C++) references
    if uses is None:
        yield
        return
    before = (uses(), sys.getrefcount(tensor))
    yield
    while (uses() > before[0] or sys.getrefcount(tensor) > before[1]) and time.monotonic() < end:
        time.sleep(_LET_GO_POLL_S)  # (the worker needs the interpreter's lock to let go of the Python object)
