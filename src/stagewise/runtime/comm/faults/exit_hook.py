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

1. prints the traceback (the previous hook), and lets the failure stand on this process's own boards, so what
   must happen on a failure happens before it is gone (the shm transport's names go, and Python's resource
   tracker is not left names a peer removed, to warn about);
2. posts the failure to the run's job key on the error board, so ranks that
   are waiting anywhere stop at once (a rank failing in a constructor has no
   pipeline board yet);
3. waits briefly: the rank whose failure stands (the *origin*) until the
   others have read it - it may host the store, and its exit would take the
   message with it - and a rank that fails *because of* another (a
   :class:`PipelineError` relayed from the board) until the origin has gone
   (it names itself in ``job/origin`` and says ``job/left`` as it goes; its
   heartbeat stops), then :data:`_RELAYED_S` more, so that torchrun observes
   the origin's exit first and its summary names the right rank (torchrun
   ranks failures by whole-second timestamps); global rank 0, which
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

A script may also catch the failure and leave by ``sys.exit(1)`` (or simply end). That way goes through the
interpreter's exit handlers, where :func:`at_exit` (called by :mod:`..lifecycle`'s, while Python is whole)
keeps the same two promises once a failure stood on one of this process's boards:

* the failing rank is blamed first: the origin, and global rank 0, wait until the others have read the failure
  (as above); every other rank leaves :data:`_RELAYED_S` after the origin has gone;
* no abort: a helper thread left in a gloo wait on the failed peer would return from it as the interpreter
  finalizes, and abort (:mod:`..blocking`). A relayed rank gives such waits :data:`_SETTLE_S` to end (the
  origin's exit closes its connections); the origin does not wait for them (they wait on ranks that leave after
  it). A wait still in torch then means the process leaves as the hook does: flushed, ``os._exit(1)``.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import traceback
import weakref
from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch.distributed as dist

from ...errors import PipelineError
from . import heartbeat
from .keys import JOB_KEY, LEFT_KEY, ORIGIN_KEY, SEEN_KEY

_installed = False
_boards: weakref.WeakSet[Any] = weakref.WeakSet()  # this process's error boards: a failure it leaves with stands there
_stores: dict[Any, Any] = {}  # the run's corners of the stores this process's boards use, by host: where to post
_origin = False  # this process posted the failure that stands on some board
_knew = False  # a failure stood on some board of this process (posted here or read)
_LINGER_S = 3.0  # at most this long, for the others to read the origin's failure
_RELAYED_S = 1.0  # a relayed failure exits after this, so torchrun sees the origin first (monitor: 0.1 s)
_SETTLE_S = 3.0  # at exit, at most this long for helper threads to come out of torch (see at_exit)


def mark_origin(store: Any = None) -> None:
    """This process's failure is the one that stands (called by the board that posted it, with its store: the
    others read there who the origin is, to leave after it)."""
    global _origin
    _origin = True
    if store is not None:
        try:
            store.set(ORIGIN_KEY, str(dist.get_rank()))
        except Exception:  # the store is gone: the others' wait for the origin is bounded
            pass


def note_failure(failure: str) -> None:
    """``failure`` stands on one of this process's boards (called by the board, posted here or read): this process
    leaves in order, and hands the failure to ``stagewise run``, which prints it last."""
    global _knew
    _knew = True
    heartbeat.failed_here()  # the script's end is no clean end now
    _hand_over(failure)


def _hand_over(failure: str) -> None:
    from ...interrupt import note_cause

    try:
        note_cause(failure)
    except Exception:  # telling the launcher must not fail the failure path
        pass


def remember_board(board: Any) -> None:
    """A board of this process: when the process leaves with an error, the error stands on it first (its
    ``leaving``), so that what must happen on a failure happens here too - the shm transport's names go, and
    Python's resource tracker is left nothing to "clean up" that a peer has removed already."""
    _boards.add(board)


def remember_store(store: Any) -> None:
    """A board looks for failures in ``store`` (its run-scoped prefix store): post there when leaving too, and
    look there for who has read (``Pipeline(store=...)`` puts a board on a store other than the default one).
    One store per host: every board of a run on one host shares its keys."""
    from ..coordinator import tcp_store_of

    host = tcp_store_of(store)
    key = (host.host, host.port) if host is not None else id(store)
    if key not in _stores:
        _stores[key] = store


def forget_stores() -> None:
    """The process group these stores served is given up (an in-place elastic job's next generation)."""
    _stores.clear()


def install() -> None:
    """Put :func:`_hook` in front of ``sys.excepthook`` (once per process)."""
    global _installed
    if _installed:
        return
    previous = sys.excepthook

    def hook(kind: type[BaseException], err: BaseException, tb: TracebackType | None) -> None:
        if issubclass(kind, KeyboardInterrupt) and _interrupted():
            return  # Ctrl-C: one line from the launcher, no traceback; the ordinary exit empties /dev/shm
        if issubclass(kind, KeyboardInterrupt) or not _to_file(kind, err, tb):
            previous(kind, err, tb)
        if issubclass(kind, KeyboardInterrupt):
            return
        if not dist.is_initialized() or dist.get_world_size() == 1:
            _hand_over(f"rank {os.environ.get('RANK', '0')}: {kind.__name__}: {err}")  # for stagewise run
            return  # the ordinary way: no peer to tell, nothing stuck to abort on
        leave(err)

    sys.excepthook = hook
    _installed = True


def _to_file(kind: type[BaseException], err: BaseException, tb: TracebackType | None) -> bool:
    """A worker of an elastic job (``stagewise run --nnodes MIN:MAX``): its traceback goes to the file the
    launcher's one line names, and its record to the launcher (:func:`stagewise.runtime.interrupt.note_failed`);
    False where that is not the case or fails (the traceback is printed then)."""
    from ...interrupt import note_failed, traceback_file

    try:
        path = traceback_file()
        refusal = not isinstance(err, (RuntimeError, OSError))  # a PipelineError, a peer's or the network's: no
        note_failed(_message(err, int(os.environ.get("RANK", "0"))).split("\n")[0], refusal)
        if path is None:
            return False
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(traceback.format_exception(kind, err, tb)))
    except Exception:
        return False
    return True


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
    for board in list(_boards):  # locally first: what must happen on a failure happens before os._exit
        try:
            board.leaving(_message(err, dist.get_rank()))
        except Exception:
            pass
    try:
        _post_and_linger(err)
    except Exception:  # leaving must not fail
        pass
    _exit_now()


def _exit_now() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    logging.shutdown()
    os._exit(1)


def at_exit(settle: Callable[[float], bool]) -> None:
    """At interpreter exit, not by an uncaught exception: after a failure, leave in order (the origin first),
    and never finalize while a helper thread is in torch (``settle(timeout)``: True once none is; see the module
    docstring) - else leave with ``os._exit(1)``. Without a failure, waits left in torch get :data:`_SETTLE_S`."""
    try:
        failed = _knew and dist.is_initialized() and dist.get_world_size() > 1
        settled = _leave_after_failure(settle) if failed else settle(_SETTLE_S)
    except Exception:  # leaving must not fail
        settled = settle(0.0)
    if not settled:
        _exit_now()


def _leave_after_failure(settle: Callable[[float], bool]) -> bool:
    from ..coordinator import DeadlineStore

    rank, world = dist.get_rank(), dist.get_world_size()
    stores = [DeadlineStore(s, _LINGER_S) for s in _stores.values()]
    if _origin or rank == 0:  # its failure must be read first (rank 0: the store goes with it)
        for store in stores:
            store.set(f"{SEEN_KEY}/{rank}", "1")
        _linger(stores, rank, world)
    if _origin:
        for store in stores:
            store.set(LEFT_KEY, str(rank))
        return settle(0.0)  # its waits are on ranks that leave after it: waiting for them would be in vain
    _await_origin(stores)
    settled = settle(_SETTLE_S)  # the origin's exit ends the waits left on it
    time.sleep(_RELAYED_S)  # after the origin, so that torchrun's summary names it
    return settled


def _await_origin(stores: list[Any]) -> None:
    """Wait until the rank whose failure stands has gone - it said it leaves, and its heartbeat stopped - so that
    this rank's exit comes after its own; at most :data:`_LINGER_S` when no rank claims the failure, and as long
    as the origin may linger (:func:`_linger`) when one does."""
    started = time.perf_counter()
    origin: int | None = None
    while True:
        waited = time.perf_counter() - started
        try:
            if origin is None:
                origin = next((int(s.get(ORIGIN_KEY).decode()) for s in stores if s.check([ORIGIN_KEY])), None)
            if origin is None and waited > _LINGER_S:
                return
            if waited > _LINGER_S + heartbeat.longest_timeout() or origin == dist.get_rank():
                return
            if origin is not None:
                left = any(s.check([LEFT_KEY]) for s in stores)
                quiet = (1.5 if left else 2.5) * heartbeat.INTERVAL_S  # a live process stamps every INTERVAL_S
                if any(r == origin for r, _ in heartbeat.silent_ranks(quiet)):
                    return
        except Exception:  # the store went with its host: the origin, or a rank that left after it
            return
        time.sleep(0.05 if waited < 1.0 else 0.25)


def _message(err: BaseException, rank: int) -> str:
    return str(err) if isinstance(err, PipelineError) else f"rank {rank}: {type(err).__name__}: {err}"


def _post_and_linger(err: BaseException) -> None:
    from ..coordinator import DeadlineStore, board_client

    rank, world = dist.get_rank(), dist.get_world_size()
    relayed = isinstance(err, PipelineError) and not _origin
    message = _message(err, rank)
    if world == 1:
        return
    if relayed:  # after the origin has gone, always (rank 0 too: torchrun must see the origin's exit first)
        known = [DeadlineStore(s, _LINGER_S) for s in _stores.values()]
        if known:
            _await_origin(known)
        time.sleep(_RELAYED_S)
        if rank != 0:
            return
    stores = [DeadlineStore(s, _LINGER_S) for s in _stores.values()] or [board_client(None, _LINGER_S, cached=True)]
    for store in stores:
        if not relayed:
            reply = store.compare_set(JOB_KEY, "", message)
            stood = reply.decode() if isinstance(reply, bytes) else str(reply)
            _hand_over(stood)
            if stood == message:
                store.set(ORIGIN_KEY, str(rank))
        store.set(f"{SEEN_KEY}/{rank}", "1")  # leaving: nothing more to read here, so nobody waits for this rank
    _linger(stores, rank, world)
    if not relayed:
        for store in stores:
            store.set(LEFT_KEY, str(rank))  # ranks leaving by sys.exit after reading it go after this one


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
