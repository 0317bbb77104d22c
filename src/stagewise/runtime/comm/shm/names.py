"""The shm transport's names in /dev/shm: removed by this process when it can, by a helper when it cannot.

A process that ends without cleaning up (SIGKILL; torchrun's SIGTERM to the
whole process group of a worker once another rank died; ``os._exit``) leaves
the names it still held, and /dev/shm is memory: a file holds its bytes until
the next reboot. Names live briefly (see :mod:`.shm`), but a job killed in its
first steps, which is when most jobs are killed, dies holding some.

So every name this process creates is registered with Python's
``multiprocessing`` resource tracker: a helper process, one per process tree,
that ignores SIGINT and SIGTERM and, once every process holding its pipe has
ended, unlinks whatever is still registered (printing that it did). A name is
unregistered as soon as this process knows it is gone - it unlinked it, or a
peer's acknowledgement says the peer did - so a clean run leaves the tracker
nothing, and it warns of nothing.
"""

from __future__ import annotations

import os
from multiprocessing import resource_tracker

from .peers import SHM_DIR

_RTYPE = "shared_memory"  # the tracker cleans these up with shm_unlink(name): any file in /dev/shm, by its name
_tracked: set[str] = set()  # this process's registrations (names relative to /dev/shm, with their leading "/")


def _name(path: str) -> str | None:
    """The shm_unlink name of a path in /dev/shm (None elsewhere: the tracker cannot reach it)."""
    head, _, tail = path.rpartition("/")
    return "/" + tail if head == SHM_DIR and tail else None


def track(path: str) -> None:
    """Have the resource tracker unlink ``path`` if this process ends still holding it (once per name)."""
    name = _name(path)
    if name is not None and name not in _tracked:
        resource_tracker.register(name, _RTYPE)
        _tracked.add(name)


def untrack(path: str) -> None:
    """``path`` is gone (or someone else removes it): the tracker forgets it. A no-op for names not tracked here."""
    name = _name(path)
    if name is not None and name in _tracked:
        _tracked.discard(name)
        resource_tracker.unregister(name, _RTYPE)


def unlink(path: str) -> None:
    """Remove a name from /dev/shm, if it is still there (a peer may have removed it first), and untrack it."""
    try:
        os.unlink(path)
    except OSError:  # gone already (the peer unlinked it), or nothing more to do
        pass
    untrack(path)


def tracked() -> set[str]:
    """The names this process has registered and not unregistered (for tests)."""
    return set(_tracked)
