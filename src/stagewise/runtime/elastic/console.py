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
the failure line names. (The launcher's own last call to the rendezvous store, which is gone when the machine
that hosted it finished first, is routed the same way, into the folder itself.) The user's prints, torch's other
warnings and any message of another shape pass as they are; a line cut between two reads is held until its end
comes or the pipe is quiet for :data:`PAUSE_S`.

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
    """The launcher's end of its workers' stderr: a pipe for each start of them, each read by a thread of its own
    until every process that holds it (the workers and what they started) has closed it."""

    def __init__(self, fd: int = 2) -> None:
        self._fd = fd
        try:
            self._console: int | None = os.dup(fd)  # where the shown bytes go, whatever ``fd`` is meanwhile
        except OSError:  # no stderr at all (closed): nothing to keep off it
            self._console = None
        self._readers: list[threading.Thread] = []

    @contextmanager
    def routed(self, into: Path) -> Iterator[None]:
        """While inside, ``fd`` is a new pipe, which the processes started meanwhile inherit as their stderr (and
        which takes the launcher's own C++ warnings meanwhile); the store warnings read from it go to ``into``."""
        if self._console is None:
            yield
            return
        read, write = os.pipe()
        reader = threading.Thread(target=_copy, args=(read, self._console, into), name="stagewise-stderr", daemon=True)
        reader.start()
        self._readers.append(reader)
        sys.stderr.flush()  # the launcher's own lines written before stay before
        os.dup2(write, self._fd)
        os.close(write)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(self._console, self._fd)  # the pipe's writing end is the workers' alone now

    def close(self, wait: float = 5.0) -> None:
        """Wait up to ``wait`` seconds for the readers to reach their pipes' ends (the workers have stopped); the
        console's descriptor is kept while one still reads (a process the workers started holds its pipe)."""
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
