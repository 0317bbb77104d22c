"""How a rank that fails leaves: posted, seen, flushed, and gone with exit code 1 - never an abort.

An exception that ends a distributed process used to end it in C++: Python's
finalisation destroys gloo process groups whose threads are still stuck on a
dead or stopped peer, and helper threads blocked in a gloo wait are torn down
mid-call; either aborts ("terminate called without an active exception",
SIGABRT). Under torchrun the aborting rank then looks like the root cause.

:func:`install` (called by :func:`stagewise.init`, and when a Pipeline is
first built, for programs that set up ``torch.distributed`` themselves) puts a
``sys.excepthook`` in front of the existing one. For an uncaught exception in
a process of a multi-process group it

1. prints the traceback (the previous hook);
2. posts the failure to the run's job key on the error board, so ranks that
   are waiting anywhere stop at once (a rank failing in a constructor has no
   pipeline board yet);
3. waits briefly: the rank whose failure stands (the *origin*) until the
   others have read it - it may host the store, and its exit would take the
   message with it - and a rank that fails *because of* another (a
   :class:`PipelineError` relayed from the board) long enough for torchrun to
   observe the origin's exit first, so its summary names the right rank
   (torchrun ranks failures by whole-second timestamps); global rank 0, which
   hosts the store under torchrun's placement, waits like the origin, so that
   slower ranks still read the failure rather than find the store gone. A
   rank can be slow for as long as a pipeline's timeout: stuck in a
   collective inside torch (FSDP2's) with a rank that left, it learns of the
   failure only when the group's timeout ends the wait. So past
   :data:`_LINGER_S`, the origin and rank 0 keep waiting - up to the longest
   pipeline timeout - while some rank that has not read is still alive
   (stamping its heartbeat);
4. flushes stdio and logging, and leaves with ``os._exit(1)``: no C++
   destructors run, so nothing aborts. ``atexit`` handlers are skipped on
   this path - the process group may have dead members, and tearing it down
   is exactly what hangs or aborts.

A clean exit and ``KeyboardInterrupt`` go the ordinary way.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from types import TracebackType

import torch.distributed as dist

from ...errors import PipelineError
from . import heartbeat

#: the run's job-level keys on the board: the first error of any process, and who has read it
JOB_KEY = "job/error"
SEEN_KEY = "job/seen"  # job/seen/<global rank>: that rank has read a failure (the failing store host waits for them)

_installed = False
_origin = False  # this process posted the failure that stands on some board
_LINGER_S = 3.0  # at most this long, for the others to read the origin's failure
_RELAYED_S = 1.0  # a relayed failure exits after this, so torchrun sees the origin first (monitor: 0.1 s)


def mark_origin() -> None:
    """This process's failure is the one that stands (called by the board that posted it)."""
    global _origin
    _origin = True


def install() -> None:
    """Put :func:`_hook` in front of ``sys.excepthook`` (once per process)."""
    global _installed
    if _installed:
        return
    previous = sys.excepthook

    def hook(kind: type[BaseException], err: BaseException, tb: TracebackType | None) -> None:
        previous(kind, err, tb)
        if issubclass(kind, KeyboardInterrupt) or not dist.is_initialized() or dist.get_world_size() == 1:
            return  # the ordinary way: no peer to tell, nothing stuck to abort on
        leave(err)

    sys.excepthook = hook
    _installed = True


def leave(err: BaseException) -> None:
    """Post ``err`` to the job key, wait as the module docstring says, flush, and exit with code 1."""
    try:
        _post_and_linger(err)
    except Exception:  # leaving must not fail
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    logging.shutdown()
    os._exit(1)


def _post_and_linger(err: BaseException) -> None:
    from ..coordinator import board_client

    rank, world = dist.get_rank(), dist.get_world_size()
    relayed = isinstance(err, PipelineError) and not _origin
    message = str(err) if isinstance(err, PipelineError) else f"rank {rank}: {type(err).__name__}: {err}"
    if world == 1:
        return
    if relayed:  # after the origin, always (rank 0 too: torchrun must see the origin's exit first)
        time.sleep(_RELAYED_S)
        if rank != 0:
            return
    store = board_client(None, _LINGER_S, cached=True)
    if not relayed:
        store.compare_set(JOB_KEY, "", message)
    started = time.perf_counter()
    while True:
        waited = time.perf_counter() - started
        unread = [r for r in range(world) if r != rank and not store.check([f"{SEEN_KEY}/{r}"])]
        if not unread or waited > _LINGER_S + heartbeat.longest_timeout():
            return
        if waited > _LINGER_S:  # those that have not read may be stuck in torch: wait while they are alive
            silent = {r for r, _ in heartbeat.silent_ranks(2.5 * heartbeat.INTERVAL_S)}
            if all(r in silent for r in unread):
                return
        time.sleep(0.05 if waited < _LINGER_S else 0.25)
