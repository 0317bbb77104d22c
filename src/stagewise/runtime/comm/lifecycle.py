"""Letting go of process groups at interpreter exit, while Python is still whole.

Two ways a rank that trained fine can abort at exit ("terminate called
without an active exception"): a daemon thread that returns from a gloo wait
while Python finalises is ended inside torch's C++ frames; and a gloo process
group destroyed during finalisation (a Pipeline still holding it after
``destroy_process_group()``) has worker threads that may drop the last
reference to a Python-owned tensor, which needs the interpreter. Exit
handlers run while Python is whole: unreferenced pipelines are collected
here, and live ones drop their references to process groups. Last, a process that knew a failure leaves in
order, and none finalizes while a helper thread is still in torch (:func:`.faults.exit_hook.at_exit`,
:mod:`.blocking`).
"""

from __future__ import annotations

import atexit
import gc
import logging
import weakref
from typing import Any

from . import blocking, groups
from .faults import exit_hook

log = logging.getLogger(__name__)

_at_exit: weakref.WeakSet[Any] = weakref.WeakSet()


def release_at_exit(owner: Any) -> None:
    """Have ``owner.release_at_exit()`` run at interpreter exit, if ``owner`` is still alive then."""
    _at_exit.add(owner)


@atexit.register
def _close_all() -> None:
    gc.collect()
    for owner in list(_at_exit):
        try:
            owner.release_at_exit()
        except Exception as err:  # an exit handler must not stop the others
            log.warning("stagewise: releasing %r at exit failed: %s", type(owner).__name__, err)
    gc.collect()
    exit_hook.at_exit(blocking.settle)


def close_now(held: Any, runner: Any, snapshots: Any, owned: list[Any]) -> None:
    """``pipe.close()``: what the exit lets go of, now, and the process groups the pipeline made destroyed.

    Dropping a pipeline is not enough: torch keeps every group (with the threads of a gloo group, which use CPU
    while idle) until it is destroyed, so a process building pipelines one after another kept them all. After a
    failure the groups are kept: a collective may be stuck in one, and destroying a gloo group waits for it.
    """
    if runner.closed:
        return
    runner.closed = True
    if snapshots is not None:
        snapshots.finish_at_exit()  # the copy in flight lands; the job's end is marked at exit, as before
    failed = held.transport is not None and held.transport.guard.failure is not None
    held.release_at_exit()
    _at_exit.discard(held)
    if not failed:
        groups.destroy([*held.made, *owned])
    held.made = []
