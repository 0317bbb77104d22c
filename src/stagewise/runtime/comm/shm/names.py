"""The shm transport's names in /dev/shm: removed by this process when it can, by a helper when it cannot.

A process that ends without cleaning up (SIGKILL; torchrun's SIGTERM to the
whole process group of a worker once another rank died; ``os._exit``) leaves
the names it still held, and /dev/shm is memory: a file holds its bytes until
the next reboot. Names live briefly (see :mod:`.transport`), but a job killed in its
first steps, which is when most jobs are killed, dies holding some.

So every name this process creates is registered with Python's
``multiprocessing`` resource tracker: a helper process, one per process tree,
that ignores SIGINT and SIGTERM and, once every process holding its pipe has
ended, unlinks whatever is still registered (printing that it did). A name is
unregistered as soon as this process knows it is gone - it unlinked it, or a
peer's acknowledgement says the peer did - so a clean run leaves the tracker
nothing, and it warns of nothing.

/dev/shm is shared by every user of the host, and a name is predictable once
its group's prefix has been seen there. So a name is opened only through
:func:`open_private`: never through a symbolic link (``O_NOFOLLOW``), and,
when a peer made it first, only if it is of the expected kind, owned by this
user and mode 0600 - a name another local user created in advance, to read or
inject activations, is refused. The side that creates a name sets 0600
itself, whatever the umask.
"""

from __future__ import annotations

import errno
import os
import stat
from multiprocessing import resource_tracker

from ...errors import PipelineError
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


def open_private(path: str, flags: int, kind: int, *, made: bool = False) -> tuple[int, bool]:
    """Open ``path`` (``flags`` as for :func:`os.open`; ``kind``: ``stat.S_IFREG`` or ``stat.S_IFIFO``), creating a
    regular file when none is there; ``(fd, created here)``. Refused with :class:`PipelineError`: a symbolic
    link, or an existing name of another kind, owner or mode than this process would have made. ``made``: this
    process has just made the name (a FIFO): its mode is set to 0600 before the check, whatever the umask."""
    if kind == stat.S_IFREG:
        try:
            fd = os.open(path, flags | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            pass
        else:
            os.fchmod(fd, 0o600)  # whatever the umask: the peer checks for exactly this
            return fd, True
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise PipelineError(f"refusing {path}: it is a symbolic link (someone else made it)") from err
        raise
    try:
        if made:
            os.fchmod(fd, 0o600)
        check_private(fd, path, kind)
    except BaseException:
        os.close(fd)
        raise
    return fd, False


def check_private(fd: int, path: str, kind: int) -> None:
    """Raise :class:`PipelineError` unless ``fd`` is a ``kind`` file owned by this user with mode 0600."""
    st = os.fstat(fd)
    found = "a FIFO" if stat.S_ISFIFO(st.st_mode) else "a regular file" if stat.S_ISREG(st.st_mode) else "not a file"
    wanted = "a FIFO" if kind == stat.S_IFIFO else "a regular file"
    problems = []
    if stat.S_IFMT(st.st_mode) != kind:
        problems.append(f"it is {found}, not {wanted}")
    if st.st_uid != os.getuid():
        problems.append(f"it belongs to uid {st.st_uid}, not to this process's {os.getuid()}")
    if stat.S_IMODE(st.st_mode) != 0o600:
        problems.append(f"its mode is {stat.S_IMODE(st.st_mode):04o}, not 0600")
    if problems:
        raise PipelineError(
            f"refusing {path}: {'; '.join(problems)} - another user may have made it to read or inject this "
            "pipeline's activations"
        )
