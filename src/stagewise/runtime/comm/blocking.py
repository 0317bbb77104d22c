"""Helper threads inside a blocking torch call, counted for the whole process: none may be left at exit.

stagewise makes calls that cannot be interrupted on helper threads (gloo waits, store calls, a group's
creation), so that the caller can watch the error board and the clock. After a failure such a thread can stay
in torch, waiting on a peer that failed. If it returns while the interpreter finalizes - the peer's exit closes
the connection - Python ends the thread inside torch's C++ frames and the process aborts ("terminate called
without an active exception", SIGABRT). So each such call runs :func:`inside`, and the exit path
(:mod:`.lifecycle`, with :func:`.faults.exit_hook.at_exit`) lets the interpreter finalize only once
:func:`settle` says none is left.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

_changed = threading.Condition()
_inside = 0


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
