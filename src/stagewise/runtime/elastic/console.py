"""The workers' stderr on a machine's console under ``stagewise run --nnodes MIN:MAX``: torch's store warnings of a
lost peer go to the folder of tracebacks, everything else to the console as it comes.

When a machine is lost, a surviving worker's TCP store client finds the store's host gone (the worker of global
rank 0 leaves after the failure, and the survivors' helper threads still ask it), and torch's C++ layer prints
some twenty lines straight to the process's stderr before it raises the same error in Python::

    [rank1]:[W1203 06:48:19.438899904 TCPStore.cpp:125] [c10d] recvValue failed on SocketImpl(fd=12, ...): Failed
    to recv, got 0 bytes. Connection was likely closed. Did the remote server shutdown or crash?
    Exception raised from recvBytes at .../torch/csrc/distributed/c10d/Utils.hpp:787 (most recent call first):
    frame #0: c10::Error::Error(c10::SourceLocation, std::__cxx11::basic_string<...>) + 0x9d (0x7fe4... in libc10.so)
    ...

Python's warning filters never see it (c10's logger writes to the file descriptor), and the one knob,
``TORCH_CPP_LOG_LEVEL``, is read once when torch loads and would hide every C++ warning of the process, the user's
own code paths' too. So each start of this machine's workers gives them a pipe as stderr (:meth:`Console.routed`),
and a thread of the launcher copies it to the console unchanged except for warnings of exactly this shape
(:class:`Divert`): the four of torch's TCP store client - ``sendBytes``, ``recvValue``, ``recvVector``,
``recvValueWithTimeout`` ``failed on`` - each of which torch raises again at once (``TCPClient`` in
``TCPStore.cpp``: a ``C10D_WARNING`` then ``throw;``), so the caller gets the same error and nothing is lost by
keeping the C++ copy off the console. They go, whole, to :data:`STORE_WARNINGS` in the attempt's folder, the one
the failure line names. (The launcher's own calls to the rendezvous store - its keep-alive thread's every second,
its main thread's - write to a pipe of their own while they run (:meth:`Console.own`), filed the same way into the
folder itself: the store's host lost, or finished first, each call warns before it raises. Only while they run: the
launcher's stderr stays the console otherwise.) The user's prints, torch's other warnings and any message of
another shape pass as they are; a line cut between two reads is held until its end comes or the pipe is quiet for
:data:`PAUSE_S`.

What changes for the workers: their stderr is a pipe, not the terminal (a library that colours only a terminal
does not colour there), and its lines may reach the console a moment after their stdout's.
"""

from __future__ import annotations

import os
import re
import select
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

#: the file in an attempt's folder of tracebacks that takes the store warnings of its workers
STORE_WARNINGS = "torch-store-warnings.txt"
#: how long a line without its end is held before it is shown (seconds without more bytes)
PAUSE_S = 0.2

# torch's TCPClient warning, which is always raised again (c10's "[W<date> <time> <file>:<line>] ", after the
# "[rank<R>]:" torch.distributed puts in front once the process group is up)
_HEAD = re.compile(
    rb"(?:\[rank\d+\]:)?\[?W\d{4} [^\]\n]*\bTCPStore\.cpp:\d+\] \[c10d\] "
    rb"(?:sendBytes|recvValue|recvVector|recvValueWithTimeout) failed on "
)
# the rest of it: c10::Error's "what()", its C++ frames; a blank line ends it
_FRAMES = re.compile(
    rb"Exception raised from \S+ at .*\(most recent call first\):$|frame #\d+: |<omitting python frames>$"
)


class Divert:
    """Bytes in, bytes out, by lines: a line of :data:`_HEAD`'s shape, its C++ frames and the blank line that ends
    the warning go to the file; every other line is shown. A line without its end yet is held (:meth:`feed`) until
    it ends or :meth:`flush` (the pipe went quiet, or closed), so a warning cut between two reads is still known."""

    def __init__(self) -> None:
        self._held = b""
        self._inside = False  # after a warning's first line: its frames follow

    @property
    def holding(self) -> bool:
        """Whether a line without its end waits for the rest."""
        return bool(self._held)

    def feed(self, data: bytes) -> tuple[bytes, bytes]:
        """What to show and what to file, of the whole lines ``data`` completes."""
        *lines, self._held = (self._held + data).split(b"\n")
        return self._sort(lines, b"\n")

    def flush(self) -> tuple[bytes, bytes]:
        """The held line, as it is."""
        held, self._held = self._held, b""
        return self._sort([held], b"") if held else (b"", b"")

    def _sort(self, lines: list[bytes], end: bytes) -> tuple[bytes, bytes]:
        shown, filed = bytearray(), bytearray()
        for line in lines:
            if _HEAD.match(line):
                self._inside = True
            elif self._inside and not line and end:
                self._inside = False  # the warning's own blank line: filed with it
            elif not (self._inside and _FRAMES.match(line)):
                self._inside = False
                shown += line + end
                continue
            filed += line + end
        return bytes(shown), bytes(filed)


class Console:
    """The launcher's end of stderr: a pipe for each start of its workers (:meth:`routed`), each read by a thread
    of its own until every process that holds it (the workers and what they started) has closed it; and one pipe
    for the launcher's own calls to the rendezvous store (:meth:`own`), from any of its threads, read until
    :meth:`close`. The descriptor ``fd`` points at the workers' pipe while they start, else at the launcher's own
    while one of its store calls runs, else at the console."""

    def __init__(self, fd: int = 2) -> None:
        self._fd = fd
        try:
            self._console: int | None = os.dup(fd)  # where the shown bytes go, whatever ``fd`` is meanwhile
        except OSError:  # no stderr at all (closed): nothing to keep off it
            self._console = None
        self._readers: list[threading.Thread] = []
        self._lock = threading.Lock()  # held only to move ``fd``, never around a call
        self._starting: int | None = None  # the writing end of the workers' pipe while they start
        self._own: int | None = None  # the writing end of the launcher's own pipe, once made
        self._calls = 0  # the launcher's store calls running now (threads: the keep-alive's and the main one)
        self._closed = False

    @contextmanager
    def routed(self, into: Path) -> Iterator[None]:
        """While inside, ``fd`` is a new pipe, which the processes started meanwhile inherit as their stderr (and
        which takes the launcher's own C++ warnings meanwhile); the store warnings read from it go to ``into``."""
        if self._console is None:
            yield
            return
        write = self._reader(into)
        with self._lock:
            self._starting = write
            self._point()
        try:
            yield
        finally:
            with self._lock:
                self._starting = None
                self._point()
            os.close(write)  # the pipe's writing end is the workers' alone now

    @contextmanager
    def own(self, into: Path) -> Iterator[None]:
        """While inside (any thread, several at once), ``fd`` is the launcher's own pipe - unless its workers are
        starting: their pipe files alike - whose store warnings go to ``into``: torch's rendezvous client warns
        in C++ when the store's machine is lost, or finished first, then raises the same error in Python."""
        if self._console is None:
            yield
            return
        with self._lock:
            if self._own is None and not self._closed:
                self._own = self._reader(into)
            self._calls += 1
            self._point()
        try:
            yield
        finally:
            with self._lock:
                self._calls -= 1
                self._point()

    def _point(self) -> None:
        """``fd`` at the pipe that should take what is written now (holding the lock)."""
        assert self._console is not None
        if self._closed:
            target = self._console
        elif self._starting is not None:
            target = self._starting
        else:
            target = self._own if self._calls and self._own is not None else self._console
        sys.stderr.flush()  # what Python holds goes where it was written
        os.dup2(target, self._fd)

    def _reader(self, into: Path) -> int:
        """A new pipe, its reading end copied by a thread of its own; its writing end."""
        assert self._console is not None
        read, write = os.pipe()
        reader = threading.Thread(target=_copy, args=(read, self._console, into), name="stagewise-stderr", daemon=True)
        reader.start()
        self._readers.append(reader)
        return write

    def close(self, wait: float = 5.0) -> None:
        """``fd`` back at the console for good; wait up to ``wait`` seconds for the readers to reach their pipes'
        ends (the workers have stopped); the console's descriptor is kept while one still reads (a process the
        workers started holds its pipe)."""
        if self._console is not None:
            with self._lock:
                self._closed = True
                self._point()
                if self._own is not None:
                    os.close(self._own)
                    self._own = None
        deadline = time.monotonic() + wait
        for reader in self._readers:
            reader.join(max(0.0, deadline - time.monotonic()))
        if self._console is not None and not any(reader.is_alive() for reader in self._readers):
            os.close(self._console)


def _copy(read: int, console: int, into: Path) -> None:
    """Copy the pipe ``read`` to ``console`` until its end, the store warnings to the file ``into``. Should the
    sorting fail, the rest is copied as it is: a pipe nobody reads would stop the workers at their next write."""
    divert = Divert()
    poll = select.poll()
    poll.register(read, select.POLLIN)
    data: bytes | None = None
    try:
        while True:
            ready = poll.poll(PAUSE_S * 1000 if divert.holding else None)
            data = _read(read) if ready else None
            shown, filed = divert.flush() if not data else divert.feed(data)
            data = None if data else data  # sorted: shown or filed below
            _write(console, shown)
            if filed and not _append(into, filed):
                _write(console, filed)  # no file to take it: shown rather than lost
            if data == b"":
                return
    except Exception:
        rest = data or b""
        while True:
            _write(console, rest)
            if not (rest := _read(read)):
                break
    finally:
        os.close(read)


def _read(fd: int) -> bytes:
    try:
        return os.read(fd, 1 << 16)
    except OSError:  # as its end
        return b""


def _write(fd: int, data: bytes) -> None:
    try:
        while data:
            data = data[os.write(fd, data) :]
    except OSError:  # the console is gone: nobody to show it to
        pass


def _append(path: Path, data: bytes) -> bool:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "ab") as f:
            f.write(data)
    except OSError:
        return False
    return True
