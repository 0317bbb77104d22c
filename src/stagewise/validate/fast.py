"""The validator's fast path: the reference checks, proved on flat integer arrays in one scan per rank.

Why a second implementation: at 128 ranks x 1024 micro-batches a complete
schedule holds up to ~1.8 M actions, and the reference checks
(:mod:`stagewise.validate.reference`) build millions of ``Message`` tuples,
sets and dicts of them, taking tens of seconds. Here a (stage, micro-batch)
pair is the int ``s * m + i``, a message is ``2 * (s * m + i)`` (+1 for an
input gradient), and everything the reference proves is decided from
bytearrays and counters:

* placement and ranges: each rank's set of stages and micro-batches, built in C;
* completeness and local order: a state per (stage, micro-batch) that may only
  go F (1) -> B (3), or F (1) -> I (2) -> W (3), and a compute action may only
  run once the value it needs is computed on this rank (or received);
* optimizer steps: a STEP finds all of its stage's backward done, and no SYNC
  of its stage follows it; one STEP per stage when the schedule has any; a SYNC
  finds all of its stage's backward done too, one per stage when it has any;
* communication: each message crossing ranks is sent once after it is made and
  received once before it is used (counts, then flags), and on each (sender,
  receiver) channel the sends and receives list the same messages in order;
* progress: the same blocking, batched rendezvous simulation as the reference
  (complete schedules) or pure data flow (compute-only ones), on int messages.

It answers only "valid or not"; when not, :func:`stagewise.validate.schedules.validate_schedule`
runs the reference to name every problem, so the messages are the reference's. Property tests hold it to
the reference rule by rule (see :mod:`stagewise.validate`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from operator import itemgetter

import numpy as np

from ..ir import SYNC, ActionRows, Columns, Kind, Schedule
from . import arrays as _validate_arrays

_F, _B, _I, _W = Kind.F, Kind.B, Kind.I, Kind.W
_SEND_F, _RECV_F, _SEND_B, _RECV_B = Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B
_SYNC, _STEP = Kind.SYNC, Kind.STEP
_stage_of, _mb_of = itemgetter(0), itemgetter(2)


def first_problem(schedule: Schedule) -> str | None:
    """A short description of one problem, or None when every check passes.

    A schedule straight from the lowering carries a progress certificate: the
    array path proves it valid on whole arrays; when it cannot (no certificate,
    one that does not fit, or a problem), the scan below decides.
    """
    certificate = schedule.__dict__.get("_progress_certificate")
    if certificate is not None and _validate_arrays.proves_valid(schedule, certificate):
        return None
    problem = _check_ranges(schedule)
    if problem is not None:
        return problem
    complete = schedule.is_complete
    problem = _Scan(schedule, complete).run()
    if problem is not None or complete:
        return problem
    return _dataflow(schedule)


def _check_ranges(schedule: Schedule) -> str | None:
    """Placement and micro-batch ranges, with set operations that run in C."""
    n, m = schedule.num_stages, schedule.num_microbatches
    if isinstance(schedule.ranks, ActionRows):  # columns: the same two facts as whole-array tests
        return _check_column_ranges(schedule, schedule.ranks.columns)
    local: list[set[int]] = [set() for _ in schedule.ranks]
    for s, r in enumerate(schedule.placement):
        local[r].add(s)
    for rank, acts in enumerate(schedule.ranks):
        if not local[rank].issuperset(map(_stage_of, acts)):
            return f"rank {rank}: an action of a stage that does not live on it (or outside 0..{n - 1})"
        mbs = set(map(_mb_of, acts))
        mbs.discard(None)
        if mbs and (min(mbs) < 0 or max(mbs) >= m):  # type: ignore[type-var, operator]
            return f"rank {rank}: a micro-batch outside 0..{m - 1}"
    return None


def _check_column_ranges(schedule: Schedule, cols: Columns) -> str | None:
    n, m = schedule.num_stages, schedule.num_microbatches
    rank, stage = cols.rank, cols.stage
    placed = np.asarray(schedule.placement, np.int64)[np.clip(stage, 0, n - 1)]
    wrong = (stage < 0) | (stage >= n) | (placed != rank)
    mb = cols.microbatch
    outside = (cols.kind < SYNC) & ((mb < 0) | (mb >= m))
    bad = np.flatnonzero(wrong | outside)
    if not bad.size:
        return None
    r = int(rank[bad[0]])  # the first rank with a problem; its stages are checked before its micro-batches
    if wrong[cols.base[r] : cols.base[r + 1]].any():
        return f"rank {r}: an action of a stage that does not live on it (or outside 0..{n - 1})"
    return f"rank {r}: a micro-batch outside 0..{m - 1}"


class _Scan:
    """Every rank's actions in order, with the local checks and the rendezvous run in the same loop.

    A rank runs until a compute action finds its current batch of communication
    not yet met by the partners (then it waits for the last partner to post),
    so each action is looked at once. On a compute-only schedule no rank waits
    here; :func:`_dataflow` then checks progress.
    """

    def __init__(self, schedule: Schedule, complete: bool) -> None:
        self.schedule = schedule
        self.complete = complete
        self.forward_only = bool(schedule.meta.get("forward_only", False))
        # an asynchronous schedule has a SYNC and a STEP per mini-batch: stagewise.validate.versions checks them
        self.asynchronous = schedule.is_asynchronous

    def run(self) -> str | None:  # noqa: C901 - one flat loop on purpose: it runs once per action
        # A hot loop, kept whole over the 60-line rule on purpose: it runs once per action (~0.35 us each;
        # 1.8 M actions for a V schedule at 128 ranks x 1024 micro-batches). Handling F, B/I and W in a
        # function each (the communication still inline) made this scan 5-10 % slower (1f1b and zb-v at
        # 128 x 1024, best of 7, measured for issue 30); the set-up and the final counts are functions.
        sch = self.schedule
        F, B, I, W = _F, _B, _I, _W  # noqa: E741 - locals: read once per action, faster than globals
        SEND_F, RECV_F, SEND_B, RECV_B, SYNC, STEP = _SEND_F, _RECV_F, _SEND_B, _RECV_B, _SYNC, _STEP
        n, m, ranks = sch.num_stages, sch.num_microbatches, sch.ranks
        p, last = len(ranks), n - 1
        in_f_cross, in_b_cross, channels, sends_f, sends_b, recvs_f, recvs_b = _crossings(sch.placement)
        state = bytearray(n * m)
        # op = 4 * (s*m + i) + 0 send of F output, +1 its receive, +2 send of input gradient, +3 its receive
        posted = bytearray(4 * n * m)
        waiter = [-1] * (4 * n * m)  # op not yet posted -> the rank whose batch waits for it
        done = [0] * n  # micro-batches whose backward of stage s is complete
        steps, synced = [0] * n, [0] * n
        complete, forward_only, asynchronous = self.complete, self.forward_only, self.asynchronous
        n_sent = n_recv = 0
        missing = [0] * p  # partners the rank's current batch still waits for
        pos = [0] * p
        queue = deque(range(p))
        while queue:
            rank = queue.popleft()
            acts, j = ranks[rank], pos[rank]
            end = len(acts)
            lacking = 0
            while j < end:
                s, k, i = acts[j]
                if k is F:
                    if lacking:
                        break
                    key = s * m + i
                    if state[key]:
                        return f"rank {rank}: {s}F{i} runs twice or after its backward"
                    if s:
                        if in_f_cross[s]:
                            if complete and not posted[4 * (key - m) + 1]:
                                return f"rank {rank}: {s}F{i} before receiving its input"
                        elif not state[key - m]:
                            return f"rank {rank}: {s}F{i} before {s - 1}F{i} on the same rank"
                    state[key] = 1
                elif k is B or k is I:
                    if lacking:
                        break
                    key = s * m + i
                    if forward_only:
                        return f"rank {rank}: backward {s}{k.value}{i} in a forward-only schedule"
                    if state[key] != 1:
                        return f"rank {rank}: {s}{k.value}{i} without its forward first, or twice"
                    if s < last:
                        if in_b_cross[s]:
                            if complete and not posted[4 * (key + m) + 3]:
                                return f"rank {rank}: {s}{k.value}{i} before receiving its output gradient"
                        elif state[key + m] < 2:
                            return f"rank {rank}: {s}{k.value}{i} before {s + 1}'s input gradient on the same rank"
                    if k is B:
                        state[key] = 3
                        done[s] += 1
                    else:
                        state[key] = 2
                elif k is W:
                    if lacking:
                        break
                    key = s * m + i
                    if forward_only:
                        return f"rank {rank}: backward {s}W{i} in a forward-only schedule"
                    if state[key] != 2:
                        return f"rank {rank}: {s}W{i} without its I first, or twice"
                    state[key] = 3
                    done[s] += 1
                else:  # communication (most actions of a complete schedule): post the op; it lacks a partner
                    # until the other side posts
                    if k is SEND_F:
                        key = s * m + i
                        op = 4 * key
                        chan = sends_f[s]
                        if chan is None or posted[op] or not state[key]:
                            return f"rank {rank}: {s}SEND_F{i} is not needed, repeated or before its forward"
                        n_sent += 1
                    elif k is RECV_F:
                        op = 4 * ((s - 1) * m + i) + 1
                        chan = recvs_f[s]
                        if chan is None or posted[op]:
                            return f"rank {rank}: {s}RECV_F{i} receives a value no other rank sends, or twice"
                        n_recv += 1
                    elif k is SEND_B:
                        key = s * m + i
                        op = 4 * key + 2
                        chan = sends_b[s]
                        if chan is None or posted[op] or state[key] < 2:
                            return f"rank {rank}: {s}SEND_B{i} is not needed, repeated or before its backward"
                        n_sent += 1
                    elif k is RECV_B:
                        op = 4 * ((s + 1) * m + i) + 3
                        chan = recvs_b[s]
                        if chan is None or posted[op]:
                            return f"rank {rank}: {s}RECV_B{i} receives a value no other rank sends, or twice"
                        n_recv += 1
                    else:
                        if asynchronous and (k is SYNC or k is STEP):
                            pass
                        elif k is SYNC:
                            if forward_only or steps[s] or synced[s] or done[s] != m:
                                return (
                                    f"rank {rank}: {s}SYNC repeated, in a forward-only schedule, before its last "
                                    "backward or after its STEP"
                                )
                            synced[s] = 1
                        elif k is STEP:
                            if forward_only or steps[s] or done[s] != m:
                                return (
                                    f"rank {rank}: {s}STEP repeated, in a forward-only schedule, or before its backward"
                                )
                            steps[s] = 1
                        else:
                            return f"rank {rank}: unknown action kind {k!r}"
                        j += 1
                        continue
                    chan.append(op >> 1)  # the message: both sides append the same number
                    posted[op] = 1
                    if posted[op ^ 1]:
                        other = waiter[op]
                        if other >= 0:
                            waiter[op] = -1
                            missing[other] -= 1
                            if not missing[other]:
                                queue.append(other)
                    else:
                        waiter[op ^ 1] = rank
                        lacking += 1
                j += 1
            pos[rank] = j
            missing[rank] = lacking
        if any(missing):
            return f"deadlock: ranks {[r for r in range(p) if missing[r]]} wait for partners that never post"
        if state.count(1 if forward_only else 3) != n * m:
            return "some (stage, micro-batch) lacks its forward or backward"
        if any(steps) and sum(steps) != n:
            return "some stage has no optimizer step while others have one"
        if any(synced) and sum(synced) != n:
            return "some stage has no gradient sync while others have one"
        if not complete:
            return None
        crossing = m * sum(in_f_cross) + (0 if forward_only else m * sum(in_b_cross))
        return _all_sent_in_order(n_sent, n_recv, crossing, channels)


#: per (sender, receiver) channel: the messages sent on it and those received, in posting order
Channels = dict[tuple[int, int], tuple[list[int], list[int]]]


#: per stage, the list of its channel that records one kind of op (None: the value does not cross ranks)
PerStage = list[list[int] | None]


def _crossings(plc: Sequence[int]) -> tuple[list[bool], list[bool], Channels, PerStage, PerStage, PerStage, PerStage]:
    """Per stage: does it take its input / its output gradient from another rank; the channels; and per stage the
    list that records, on its channel, its sends of outputs, of input gradients, its receives of inputs and of
    output gradients (None where the value does not cross)."""
    n = len(plc)
    last = n - 1
    in_f_cross = [s > 0 and plc[s - 1] != plc[s] for s in range(n)]
    in_b_cross = [s < last and plc[s + 1] != plc[s] for s in range(n)]
    channels: Channels = {}
    for s in range(n):
        for other in (s - 1, s + 1):
            if 0 <= other < n and plc[other] != plc[s]:
                channels.setdefault((plc[s], plc[other]), ([], []))
    sends_f = [channels[(plc[s], plc[s + 1])][0] if in_b_cross[s] else None for s in range(n)]
    sends_b = [channels[(plc[s], plc[s - 1])][0] if in_f_cross[s] else None for s in range(n)]
    recvs_f = [channels[(plc[s - 1], plc[s])][1] if in_f_cross[s] else None for s in range(n)]
    recvs_b = [channels[(plc[s + 1], plc[s])][1] if in_b_cross[s] else None for s in range(n)]
    return in_f_cross, in_b_cross, channels, sends_f, sends_b, recvs_f, recvs_b


def _all_sent_in_order(n_sent: int, n_recv: int, crossing: int, channels: Channels) -> str | None:
    """Every crossing value sent and received (each op was posted at most once), and on each channel the sends
    and the receives in the same order."""
    if n_sent != crossing or n_recv != crossing:
        return f"{n_sent} sends and {n_recv} receives for {crossing} values crossing ranks"
    for (src, dst), (sent, got) in channels.items():
        if sent != got:
            return f"channel rank {src} -> rank {dst}: sends and receives disagree in order"
    return None


def _dataflow(schedule: Schedule) -> str | None:
    """Compute-only schedules: every rank finishes when each action waits for its inputs."""
    n, m = schedule.num_stages, schedule.num_microbatches
    last = n - 1
    ranks = schedule.ranks
    made = bytearray(2 * n * m)
    waiting: dict[int, int] = {}
    pos = [0] * len(ranks)
    queue = deque(range(len(ranks)))
    while queue:
        rank = queue.popleft()
        acts, j = ranks[rank], pos[rank]
        end = len(acts)
        while j < end:
            s, k, i = acts[j]
            if k is _F:
                if s:
                    need = 2 * ((s - 1) * m + i)
                    if not made[need]:
                        waiting[need] = rank
                        break
                if s < last:
                    out = 2 * (s * m + i)
                    made[out] = 1
                    if out in waiting:
                        queue.append(waiting.pop(out))
            elif k is _B or k is _I:
                if s < last:
                    need = 2 * ((s + 1) * m + i) + 1
                    if not made[need]:
                        waiting[need] = rank
                        break
                if s:
                    out = 2 * (s * m + i) + 1
                    made[out] = 1
                    if out in waiting:
                        queue.append(waiting.pop(out))
            j += 1
        pos[rank] = j
    stuck = [r for r in range(len(ranks)) if pos[r] < len(ranks[r])]
    return f"deadlock: ranks {stuck} wait for values nobody makes first" if stuck else None
