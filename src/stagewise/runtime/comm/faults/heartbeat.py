"""Signs of life: which rank is stuck, when a wait times out somewhere down a chain of waits.

When rank 1 is stopped, rank 2 waits for rank 1 and rank 3 for rank 2; whoever's
deadline passes first posts, and "rank 3 waited for rank 2" blames the wrong
rank. So each process stamps ``alive/<global rank>`` in the run's corner of
the store (:mod:`.coordinator`) every :data:`INTERVAL_S` seconds from a daemon
thread, on a connection of its own; a rank whose deadline passes reads every
stamp and names the ranks silent for more than half the timeout - a stopped
or dead process stops stamping, a busy one does not.

The stamps are wall-clock times (``time.time()``): ranks on one host share the
clock, and hosts' clocks agree far better than the timeouts involved.
"""

from __future__ import annotations

import atexit
import threading
import time
from typing import Any

import torch.distributed as dist

INTERVAL_S = 1.0

_thread: threading.Thread | None = None
_stop = threading.Event()
_store: Any = None
_timeout = 0.0  # the longest timeout of the boards that started the stamping


def start(timeout: float) -> None:
    """Start stamping (once per process; no-op on one rank or without a process group)."""
    global _thread, _store, _timeout
    _timeout = max(_timeout, timeout)
    if _thread is not None or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    from ..coordinator import board_client

    _store = board_client(None, timeout, own=True)
    rank = dist.get_rank()
    stamp(rank)
    _thread = threading.Thread(target=_run, args=(rank,), name="stagewise-heartbeat", daemon=True)
    _thread.start()


def stamp(rank: int) -> None:
    if _store is not None:
        _store.set(f"alive/{rank}", repr(time.time()))


def _run(rank: int) -> None:
    while not _stop.wait(INTERVAL_S):
        try:
            stamp(rank)
        except Exception:  # the store is gone: the board reports that; stop stamping
            return


def silent_ranks(threshold: float) -> list[tuple[int, float | None]]:
    """``(global rank, seconds since its last stamp, or None if it never stamped)`` for ranks silent > threshold."""
    if _store is None:
        return []
    now = time.time()
    out: list[tuple[int, float | None]] = []
    for r in range(dist.get_world_size()):
        key = f"alive/{r}"
        if not _store.check([key]):
            out.append((r, None))
            continue
        age = now - float(_store.get(key).decode())
        if age > threshold:
            out.append((r, age))
    return out


def longest_timeout() -> float:
    """The longest pipeline timeout this process has seen (0 before any board): how long a peer may be stuck."""
    return _timeout


def describe_silent(timeout: float) -> str:
    """A clause naming the silent ranks (empty if none, or if the store cannot be read)."""
    try:
        silent = silent_ranks(max(2.0, timeout / 2))
    except Exception:
        return ""
    if not silent:
        return ""
    parts = [f"global rank {r} ({'never' if age is None else f'{age:.1f} s ago'})" for r, age in silent]
    return f"; last sign of life: {', '.join(parts)} - stopped or dead?"


def _stamps() -> dict[int, str | None]:
    out: dict[int, str | None] = {}
    for r in range(dist.get_world_size()):
        key = f"alive/{r}"
        out[r] = _store.get(key).decode() if _store.check([key]) else None
    return out


def describe_stopped(within: float = 2.5 * INTERVAL_S) -> str:
    """After a communication failure: a clause naming the ranks that stamp nothing new for ``within`` seconds.

    A killed peer makes gloo report "connection closed" without saying which peer; its stamp stops advancing,
    while every live rank stamps every :data:`INTERVAL_S`. Costs ``within`` seconds, on the failure path only.
    """
    if _store is None:
        return ""
    try:
        before = _stamps()
        time.sleep(within)
        after = _stamps()
    except Exception:
        return ""
    still = [r for r in before if r != dist.get_rank() and before[r] == after[r]]
    if not still:
        return ""
    return f"; no sign of life for {within:g} s from global rank {', '.join(map(str, still))} - stopped or dead?"


@atexit.register
def _halt() -> None:
    """Stop the thread while Python is whole (a daemon thread ending inside a store call at exit could abort)."""
    _stop.set()
    if _thread is not None:
        _thread.join(2.0)
