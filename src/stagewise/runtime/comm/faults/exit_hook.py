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
   (stamping its heartbeat). A rank leaving with a failure of its own has
   nothing left to read: it says so as it posts (``job/seen/<rank>``), and
   nobody waits for it - when every rank fails at once (a refused checkpoint
   raises alike everywhere), each leaves as soon as the others have posted;
4. flushes stdio and logging, and leaves with ``os._exit(1)``: no C++
   destructors run, so nothing aborts. ``atexit`` handlers are skipped on
   this path - the process group may have dead members, and tearing it down
   is exactly what hangs or aborts.

A clean exit and ``KeyboardInterrupt`` go the ordinary way; a worker of a job interrupted by Ctrl-C
prints no traceback: it tells the launcher where it stopped (:mod:`stagewise.runtime.interrupt`).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from types import TracebackType
from typing import Any

import torch.distributed as dist

from ...errors import PipelineError
from . import heartbeat
from .keys import JOB_KEY, SEEN_KEY

_installed = False
_stores: dict[Any, Any] = {}  # the run's corners of the stores this process's boards use, by host: where to post
_origin = False  # this process posted the failure that stands on some board
_LINGER_S = 3.0  # at most this long, for the others to read the origin's failure
_RELAYED_S = 1.0  # a relayed failure exits after this, so torchrun sees the origin first (monitor: 0.1 s)


def mark_origin() -> None:
    """This process's failure is the one that stands (called by the board that posted it)."""
    global _origin
    _origin = True


def remember_store(store: Any) -> None:
    """A board looks for failures in ``store`` (its run-scoped prefix store): post there when leaving too, and
    look there for who has read (``Pipeline(store=...)`` puts a board on a store other than the default one).
    One store per host: every board of a run on one host shares its keys."""
    from ..coordinator import tcp_store_of

    host = tcp_store_of(store)
    key = (host.host, host.port) if host is not None else id(store)
    if key not in _stores:
        _stores[key] = store


def install() -> None:
    """Put :func:`_hook` in front of ``sys.excepthook`` (once per process)."""
    global _installed
    if _installed:
        return
    previous = sys.excepthook

    def hook(kind: type[BaseException], err: BaseException, tb: TracebackType | None) -> None:
        if issubclass(kind, KeyboardInterrupt) and _interrupted():
            return  # Ctrl-C: one line from the launcher, no traceback; the ordinary exit empties /dev/shm
        previous(kind, err, tb)
        if issubclass(kind, KeyboardInterrupt) or not dist.is_initialized() or dist.get_world_size() == 1:
            return  # the ordinary way: no peer to tell, nothing stuck to abort on
        leave(err)

    sys.excepthook = hook
    _installed = True


def _interrupted() -> bool:
    """A worker of a job was interrupted: say where it stopped (:func:`stagewise.runtime.interrupt.stopped`);
    False where that is not the case or fails (the ordinary traceback then)."""
    from ...interrupt import FOLDER_ENV, stopped

    if not (dist.is_initialized() or os.environ.get(FOLDER_ENV)):
        return False
    try:
        stopped()
    except Exception:
        return False
    return True


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
    from ..coordinator import DeadlineStore, board_client

    rank, world = dist.get_rank(), dist.get_world_size()
    relayed = isinstance(err, PipelineError) and not _origin
    message = str(err) if isinstance(err, PipelineError) else f"rank {rank}: {type(err).__name__}: {err}"
    if world == 1:
        return
    if relayed:  # after the origin, always (rank 0 too: torchrun must see the origin's exit first)
        time.sleep(_RELAYED_S)
        if rank != 0:
            return
    stores = [DeadlineStore(s, _LINGER_S) for s in _stores.values()] or [board_client(None, _LINGER_S, cached=True)]
    for store in stores:
        if not relayed:
            store.compare_set(JOB_KEY, "", message)
        store.set(f"{SEEN_KEY}/{rank}", "1")  # leaving: nothing more to read here, so nobody waits for this rank
    _linger(stores, rank, world)


def _linger(stores: list[Any], rank: int, world: int) -> None:
    """Wait while some other rank has neither read the failure nor left with one of its own (see the module
    docstring): at most :data:`_LINGER_S`, then while such a rank is alive, up to the longest timeout."""
    started = time.perf_counter()
    while True:
        waited = time.perf_counter() - started
        unread = [r for r in range(world) if r != rank and not any(s.check([f"{SEEN_KEY}/{r}"]) for s in stores)]
        if not unread or waited > _LINGER_S + heartbeat.longest_timeout():
            return
        if waited > _LINGER_S:  # those that have not read may be stuck in torch: wait while they are alive
            silent = {r for r, _ in heartbeat.silent_ranks(2.5 * heartbeat.INTERVAL_S)}
            if all(r in silent for r in unread):
                return
        time.sleep(0.05 if waited < _LINGER_S else 0.25)
