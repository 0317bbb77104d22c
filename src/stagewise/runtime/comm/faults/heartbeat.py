"""Signs of life: which rank is stuck, when a wait times out somewhere down a chain of waits.

When rank 1 is stopped, rank 2 waits for rank 1 and rank 3 for rank 2; whoever's
deadline passes first posts, and "rank 3 waited for rank 2" blames the wrong
rank. So each process stamps ``alive/<global rank>`` in the run's corner of
the store (:mod:`..coordinator`) every :data:`INTERVAL_S` seconds from a daemon
thread, on a connection of its own; a rank whose deadline passes reads every
stamp and names the ranks silent for more than half the timeout - a stopped
or dead process stops stamping, a busy one does not - in the *first* words of
its message (:func:`blame_silent`; :func:`blame_stopped` after gloo reports a
closed connection), so the first line a user reads blames the right rank:

    global rank 1 stopped or died (no sign of life for 6.2 s); rank 3 waited 10.1 s for ...

The stamps are wall-clock times (``time.time()``): ranks on one host share the
clock, and hosts' clocks agree far better than the timeouts involved.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from . import calls, probe
from .keys import JOB_KEY

log = logging.getLogger(__name__)

INTERVAL_S = 1.0

_thread: threading.Thread | None = None
_stop = threading.Event()
_store: Any = None
_timeout = 0.0  # the longest timeout of the boards that started the stamping
_probes = probe.Probes()  # the peers' liveness ports, once reached (:mod:`.probe`)
REACH_S = 0.1  # how often the peers' ports not reached yet are tried, for HURRY_S after the start
HURRY_S = 30.0
CONFIRM_S = 0.25  # the most a beat spends reaching peers' ports (a stamp must not wait behind them)
_posted = threading.Event()  # this process posted the run's failure, or read it on the store
_read_at = 0.0  # when :func:`failure_posted` last read the store
_lost_silence_s = 3.0  # :func:`set_lost_silence`


def start(timeout: float, *, pipeline: bool = True) -> None:
    """Start stamping (once per process; no-op on one rank or without a process group); ``timeout`` bounds each
    store call, and (``pipeline``: a pipeline's own timeout) how long the exit hook may wait for a stuck peer.

    Also lets the coordinator's bounded calls (:func:`..coordinator.call_with_deadline`, which the link probes
    and calibration use before any pipeline exists) stop at a failure posted for the job, and name the silent
    ranks when their deadline passes.
    """
    global _thread, _store, _timeout, _rank, _ending_set
    if pipeline:
        _timeout = max(_timeout, timeout)
    if _thread is not None or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    from ..coordinator import board_client, watch_calls

    _store = board_client(None, timeout, own=True)
    rank = dist.get_rank()
    stamp(rank)
    _publish_calls(rank)
    _publish_port(rank)
    _thread = threading.Thread(target=_run, args=(rank, _stop), name="stagewise-heartbeat", daemon=True)
    _thread.start()
    _rank = rank
    if not _ending_set:  # registered after lifecycle's exit handler: runs before it, while the groups are whole
        atexit.register(_ending)
        _ending_set = True
    watch_calls(job_failure, blame_silent)


def stamp(rank: int) -> None:
    if _store is not None:
        _store.set(f"alive/{rank}", repr(time.time()))


_failed = False  # a failure stood on one of this process's boards (:func:`failed_here`)
_rank = -1  # this process's global rank in the membership stamping now
_ending_set = False
_at: dict[str, str] = {}  # what ``at/<rank>/<scope>`` says now: this process's collective calls (:mod:`.calls`)
_publishing = threading.Lock()  # the thread's publish and the exit's: the later state is the one that stands


def store() -> Any:
    """The run's corner of the store, on the heartbeat's own connection (None before :func:`start`)."""
    return _store


def _publish_calls(rank: int) -> None:
    """Publish ``at/<rank>/<scope>`` for each pipeline whose count of collective calls or state changed here."""
    with _publishing:
        for scope, now in calls.published().items():
            if _at.get(scope) != now and _store is not None:
                _store.set(f"at/{rank}/{scope}", now)
                _at[scope] = now


def _publish_port(rank: int) -> None:
    """Publish ``probe/<rank>``: where this process's liveness port is reached (:mod:`.probe`)."""
    from ..coordinator import tcp_store_of

    try:
        tcp = tcp_store_of(dist.distributed_c10d._get_default_store())
        host = probe.address_towards(tcp.host, tcp.port) if tcp is not None else "127.0.0.1"
        _store.set(f"probe/{rank}", f"{host}:{probe.listen()}")
    except Exception as err:  # no evidence then: a failure's culprit is named after the window
        log.debug("stagewise heartbeat: no liveness port published: %s", err)


def _run(rank: int, stop: threading.Event) -> None:
    """Stamp every :data:`INTERVAL_S`; between stamps, take in probes and reach the peers' ports (every
    :data:`REACH_S` while some are not reached yet: a peer killed early must not find them unknown)."""
    probes, stamped = _probes, time.monotonic()
    hurry_until = stamped + HURRY_S
    while True:
        try:
            probe.drain()
            everyone = _reach_ports(rank, probes)
            if time.monotonic() - stamped >= INTERVAL_S:
                stamp(rank)
                _publish_calls(rank)
                stamped = time.monotonic()
        except Exception:  # the store is gone: the board reports that; stop stamping
            return
        soon = not everyone and time.monotonic() < hurry_until
        if stop.wait(REACH_S if soon else INTERVAL_S - (time.monotonic() - stamped)):
            return


def _reach_ports(rank: int, probes: probe.Probes) -> bool:
    """Connect once to each peer's published port not reached yet (a refusal from it is evidence later);
    whether every peer's is reached now."""
    until = time.perf_counter() + CONFIRM_S
    todo = [r for r in range(dist.get_world_size()) if r != rank and r not in probes.reached]
    for r in todo:
        key = f"probe/{r}"
        if time.perf_counter() < until and _store is not None and _store.check([key]):
            probes.confirm(r, _store.get(key).decode())
    return all(r in probes.reached for r in todo)


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


def set_lost_silence(seconds: float) -> None:
    """How long a rank's stamps stand still, once the run's failure is posted, before :func:`lost_ranks` names it
    lost: an in-place job's ``InPlace(silence_s=)``, the same bound that posted a stopped machine's failure (a job
    that raised it for oversubscribed cores must not give up a live peer's copy sooner)."""
    global _lost_silence_s
    _lost_silence_s = float(seconds)


def lost_ranks(silence: float | None = None) -> set[int]:
    """The other global ranks known lost now: their port refuses (the process is gone), or their stamps stood
    still for more than ``silence`` seconds (default: :func:`set_lost_silence`'s; a live rank stamps from a
    thread of its own, however slow its steps: a stopped or cut-off machine). A rank that never stamped is not
    evidence (a corner just made, a rank just started). Empty when nothing can be read."""
    bound = _lost_silence_s if silence is None else silence
    try:
        out = {r for r, age in silent_ranks(bound) if age is not None} | set(_probes.gone())
        out.discard(dist.get_rank())
    except Exception:  # no store, no group: no evidence
        return set()
    return out


def longest_timeout() -> float:
    """The longest pipeline timeout this process has seen (0 before any board): how long a peer may be stuck."""
    return _timeout


def blame_silent(timeout: float) -> str:
    """The rank(s) at fault when a deadline passed, for the *first* words of the message: the ranks silent for
    more than half the timeout (``"global rank 1 stopped or died (no sign of life for 6.2 s)"``), or ""."""
    try:
        silent = silent_ranks(_threshold(timeout))
    except Exception:
        return ""
    others = [(r, age) for r, age in silent if r != dist.get_rank()]
    return blame(sorted(others, key=lambda x: -(x[1] if x[1] is not None else float("inf"))))  # longest first


def _threshold(timeout: float) -> float:
    """Silence longer than this is not a busy rank: half the timeout, and never under 2.5 stamps."""
    return max(2.5 * INTERVAL_S, timeout / 2)


def blame(silent: Sequence[tuple[int, float | None]]) -> str:
    """``(global rank, seconds silent or None)`` in the words every failure's first line uses, or ""."""
    if not silent:
        return ""
    ranks = ", ".join(str(r) for r, _ in silent)
    ages = [age for _, age in silent if age is not None]
    since = f"no sign of life for {max(ages):.1f} s" if ages else "no sign of life yet"
    many = "s" if len(silent) > 1 else ""
    return f"global rank{many} {ranks} stopped or died ({since})"


def job_failure() -> str | None:
    """The failure a process of this job posted when it ended (:mod:`.exit_hook`), or None; read on the
    heartbeat's own connection (raises if the store cannot be reached)."""
    if _store is None or not _store.check([JOB_KEY]):
        return None
    return str(_store.get(JOB_KEY).decode())


def post_failure(text: str) -> None:
    """Post ``text`` as this run's failure, unless one stands (every board reads it at its next look; the
    first words name the dead). For an in-place job's survivor whose generation failed: ranks of another
    pipeline share no board with it, and one waiting on a live peer that left their collective would wait
    out its timeout (seen: a stage's replicas' all-reduce, when the lost machine held the other stage's)."""
    _posted.set()
    try:
        if _store is not None:
            _store.compare_set(JOB_KEY, "", text)
    except Exception:  # the store is gone: the boards say so themselves
        log.debug("stagewise heartbeat: the failure was not posted for the run")


def failure_posted(every: float = 0.5) -> bool:
    """Whether this run's failure is posted: by this process (:func:`post_failure`: known at once), or by another
    (read on the store at most every ``every`` seconds). What a helper's wait on peers gives up at: a peer that
    has not begun its part by then never will (:func:`..snapshot_exchange.exchange_settled`)."""
    global _read_at
    if _posted.is_set():
        return True
    now = time.monotonic()
    if _store is None or now - _read_at < every:
        return False
    _read_at = now
    try:
        found = job_failure() is not None
    except Exception:  # the store is gone: the boards say so
        return False
    if found:
        _posted.set()
    return found


def _stamps() -> dict[int, str | None]:
    out: dict[int, str | None] = {}
    for r in range(dist.get_world_size()):
        key = f"alive/{r}"
        out[r] = _store.get(key).decode() if _store.check([key]) else None
    return out


def blame_stopped(within: float = 2.5 * INTERVAL_S) -> str:
    """After a communication failure, the first words of the message: the other ranks whose stamp does not
    advance in ``within`` seconds (``"global rank 1 stopped or died (no sign of life for 2.5 s)"``), or "".

    A killed peer makes gloo report "connection closed" without saying which peer. First the evidence that
    cannot name a live rank: the peers whose liveness port now refuses (:mod:`.probe`: their process is gone),
    named at once (``"global rank 1 stopped or died (its process is gone: ...)"``). Else the window: a dead
    rank's stamp stops advancing, while every live rank stamps every :data:`INTERVAL_S`; costs ``within``
    seconds, on the failure path only - unless a port refuses meanwhile (a killed process's sockets close one
    by one: gloo's may fail before its port refuses), which ends the window and is named instead.
    """
    return blame_gone() or blame([(r, within) for r in stopped_ranks(within)]) or blame_gone()


def blame_failed(timeout: float) -> str:
    """After a failed collective (a closed connection, or gloo's own timeout: the groups' is the pipeline's),
    the first words of the message from the surest evidence first: the peers whose process is gone
    (:func:`blame_gone`), else the ones silent past half of ``timeout`` (:func:`blame_silent`: a stopped or
    cut-off peer, when gloo's timeout ended the op), else the window of :func:`blame_stopped`."""
    return blame_gone() or blame_silent(timeout) or blame_stopped()


def blame_gone() -> str:
    """The other ranks whose liveness port now refuses (:mod:`.probe`: their process is gone, for sure), named
    (``"global rank 1 stopped or died (process gone: its port refuses connections)"``), or ""."""
    try:
        gone = [r for r in _probes.gone() if r != dist.get_rank()]
        if len(gone) > 1:  # the first to go first: the likeliest cause (others may have left after it)
            stamps = _stamps()
            gone.sort(key=lambda r: float(stamps.get(r) or 0.0))
    except Exception:  # no evidence
        return ""
    if not gone:
        return ""
    many = "s" if len(gone) > 1 else ""
    ports = "their ports refuse" if many else "its port refuses"
    return f"global rank{many} {', '.join(map(str, gone))} stopped or died (process gone: {ports} connections)"


def stopped_ranks(within: float) -> list[int]:
    """The other ranks whose stamp does not advance in ``within`` seconds (empty if the store cannot be read)."""
    if _store is None:
        return []
    try:
        before = _stamps()
        if _refused_within(within):  # (:func:`blame_stopped` names it from the ports)
            return []
        after = _stamps()
    except Exception:
        return []
    still = [r for r in before if r != dist.get_rank() and before[r] == after[r]]
    return sorted(still, key=lambda r: float(before[r] or 0.0))  # the longest silent first: the likeliest cause


def probe_report() -> dict[int, str]:
    """By peer rank: where its liveness port was probed from here and what the last probe got (a recovery's
    record: which evidence a survivor had, and why it had none)."""
    got = _probes.report()
    try:
        world, me = dist.get_world_size(), dist.get_rank()
    except Exception:  # no group any more
        return got
    return {r: got.get(r, "never probed (port not published or not read yet)") for r in range(world) if r != me}


def _refused_within(within: float) -> bool:
    """Wait ``within`` seconds, asking the ports reached every :data:`REACH_S`; True as soon as one refuses."""
    end = time.monotonic() + within
    while (left := end - time.monotonic()) > 0:
        time.sleep(min(REACH_S, left))
        if _probes.gone():
            return True
    return False


def stop() -> None:
    """Stop stamping for this process group (an in-place elastic job's next generation starts it again)."""
    global _thread, _stop, _store, _probes, _posted
    _stop.set()
    if _thread is not None:
        _thread.join(2 * INTERVAL_S)
    _thread, _stop, _store, _probes, _posted = None, threading.Event(), None, probe.Probes(), threading.Event()
    _at.clear()
    calls.reset()  # the next membership counts its calls from zero, newcomers and survivors alike


@atexit.register
def _halt() -> None:
    """Stop the thread while Python is whole (a daemon thread ending inside a store call at exit could abort)."""
    _stop.set()
    if _thread is not None:
        _thread.join(2.0)


def _ending() -> None:
    """Say that this script ended, unless it leaves with a failure (the failure is the news then): before the
    process groups close, so a peer whose wait fails on the closed connection reads why (:func:`blame_ended`)."""
    if _store is not None and not _posted.is_set() and not _failed:
        calls.ended()
        try:
            _publish_calls(_rank)
        except Exception:  # the store is gone: peers learn of the exit from the closed connections
            pass


def failed_here() -> None:
    """A failure stood on one of this process's boards (:mod:`.exit_hook` says so): its end is no clean end."""
    global _failed
    _failed = True
