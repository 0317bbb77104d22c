"""Lowering passes: compute-only schedule -> complete schedule the runtime can execute.

Each pass is a pure function Schedule -> Schedule. :func:`lower` chains them and
validates the result, so a generator bug surfaces as a clear error here rather
than as a hang on a cluster.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import deque
from operator import itemgetter

from . import _validate_fast
from ._gc import gc_paused
from .actions import COMM, COMPUTE, Action, Kind
from .schedule import Schedule
from .validate import ScheduleError, dataflow_problems, validate_schedule

_F, _B, _W = Kind.F, Kind.B, Kind.W
_SEND_F, _SEND_B, _RECV_F, _RECV_B = Kind.SEND_F, Kind.SEND_B, Kind.RECV_F, Kind.RECV_B
_COMPUTE = COMPUTE
_kind_of = itemgetter(1)


def split_backward(schedule: Schedule) -> Schedule:
    """Replace every full backward ``B`` by ``I`` immediately followed by ``W``.

    The result computes the same gradients; it exists so a schedule written
    with B can be timed and run with the zero-bubble machinery.
    """
    ranks = []
    for acts in schedule.ranks:
        out: list[Action] = []
        for a in acts:
            if a.kind is Kind.B:
                out += [Action(a.stage, Kind.I, a.microbatch), Action(a.stage, Kind.W, a.microbatch)]
            else:
                out.append(a)
        ranks.append(out)
    return schedule.with_ranks(ranks)


def add_grad_sync(schedule: Schedule) -> Schedule:
    """Insert ``SYNC`` for each stage right after its last weight-gradient work (B or W).

    From that point the stage's gradients are final, so data-parallel
    all-reduce or tied-weight reduction can start while other stages drain.
    """
    return schedule.with_ranks(
        [_insert_after_last(acts, schedule.stages_of(rank), Kind.SYNC) for rank, acts in enumerate(schedule.ranks)]
    )


def _insert_after_last(acts: tuple[Action, ...], stages: tuple[int, ...], kind: Kind) -> list[Action]:
    """``acts`` with ``Action(s, kind)`` right after the last B/W (or SYNC, for STEP) of each stage s.

    Scans from the end, where the last weight work is, and stops once every
    local stage is found: a pass over millions of actions touches only the tail.
    """
    after = (Kind.B, Kind.W) if kind is Kind.SYNC else (Kind.B, Kind.W, Kind.SYNC)
    last: dict[int, int] = {}
    wanted = len(stages)
    for idx in range(len(acts) - 1, -1, -1):
        s, k, _ = acts[idx]
        if k in after and s not in last:
            last[s] = idx
            if len(last) == wanted:
                break
    out = list(acts)
    by_index: dict[int, list[int]] = {}
    for stage, idx in last.items():
        by_index.setdefault(idx, []).append(stage)
    for idx in sorted(by_index, reverse=True):  # from the back, so earlier indices stay put
        out[idx + 1 : idx + 1] = [Action(stage, kind) for stage in sorted(by_index[idx])]
    return out


def add_communication(schedule: Schedule) -> Schedule:
    """Add SEND/RECV actions for every value that crosses ranks.

    Sends go right after the compute that made the value. Each receive goes
    into the consumer rank's first batch that starts once the value exists,
    judged by timing the compute-only schedule (uniform costs, free
    transfers). Between two compute actions a rank so posts one batch: what
    it just made, and what has meanwhile been made for it.

    Why this cannot deadlock under blocking, batched point-to-point: order all
    messages by the time they are made; every rank meets the batches holding
    them in that same order, so no two ranks wait on each other in a cycle,
    and on each (sender, receiver) channel sends and receives agree in order.
    Putting each receive just before its consumer instead deadlocks looped
    schedules (interleaved, breadth-first): a sender blocks until a consumer
    that is itself waiting on it posts the receive.
    """
    if any(not COMM.isdisjoint(map(_kind_of, acts)) for acts in schedule.ranks):
        raise ValueError(f"schedule {schedule.name!r} already has communication actions")
    timing = _time_uniform(schedule)
    if timing is None:  # the order itself cannot finish: say where
        raise ScheduleError(schedule, dataflow_problems(schedule))
    return schedule.with_ranks([_with_comm(schedule, rank, recvs) for rank, recvs in enumerate(timing)])


#: A receive to insert: (compute index it goes before, made-order key, the RECV action).
_Recv = tuple[int, int, Action]


def _time_uniform(schedule: Schedule) -> list[list[_Recv]] | None:
    """Time the compute actions (F = I = W = 1, B = 2, free transfers); per rank, its receives in order.

    The same timing as ``simulate(schedule.compute_only())``, on integers: a
    receive goes before the first compute action of its rank that starts no
    earlier than the value is made (never after its consumer), and receives
    sharing a slot go in the order their values were made (time, rank, index).
    Returns None when some rank waits for a value that nobody makes first.
    """
    n, m, p, plc = schedule.num_stages, schedule.num_microbatches, schedule.num_ranks, schedule.placement
    last = n - 1
    # messages are ints 2 * (s*m + i) (+1: input gradient); per stage, the base of what F / B,I need and make
    # across ranks, or -1 when that value stays on the rank (or does not exist)
    need_f = [2 * (s - 1) * m if s > 0 and plc[s - 1] != plc[s] else -1 for s in range(n)]
    need_b = [2 * (s + 1) * m + 1 if s < last and plc[s + 1] != plc[s] else -1 for s in range(n)]
    make_f = [2 * s * m if s < last and plc[s + 1] != plc[s] else -1 for s in range(n)]
    make_b = [2 * s * m + 1 if s > 0 and plc[s - 1] != plc[s] else -1 for s in range(n)]
    compute = [[a for a in acts if a[1] in _COMPUTE] for acts in schedule.ranks]
    span = max(map(len, compute)) + 1
    per_time = p * span
    made = [-1] * (2 * n * m)  # message -> made-order key (end time, rank, compute index) as one int
    waiting: dict[int, int] = {}
    starts: list[list[int]] = [[] for _ in range(p)]
    recvs: list[list[_Recv]] = [[] for _ in range(p)]
    clock, pos = [0] * p, [0] * p
    new = tuple.__new__
    queue = deque(range(p))
    while queue:
        rank = queue.popleft()
        acts, t, k, end = compute[rank], clock[rank], pos[rank], len(compute[rank])
        began, pending = starts[rank], recvs[rank]
        while k < end:
            s, kind, i = acts[k]
            if kind is _F:
                nb, ob, took, rk = need_f[s], make_f[s], 1, _RECV_F
            elif kind is _W:
                nb = ob = -1
                took = 1
            else:
                nb, ob, took, rk = need_b[s], make_b[s], 2 if kind is _B else 1, _RECV_B
            if nb >= 0:
                key = made[nb + 2 * i]
                if key < 0:
                    waiting[nb + 2 * i] = rank
                    break
                ready = key // per_time
                # the first earlier start no sooner than ready; none (the slot is k) when the rank idled for it
                slot = k if not k or ready > began[-1] else bisect_left(began, ready)
                pending.append((slot, key, new(Action, (s, rk, i))))
                if ready > t:
                    t = ready
            began.append(t)
            t += took
            if ob >= 0:
                out = ob + 2 * i
                made[out] = (t * p + rank) * span + k
                if out in waiting:
                    queue.append(waiting.pop(out))
            k += 1
        clock[rank], pos[rank] = t, k
    if waiting:
        return None
    for pending in recvs:
        pending.sort()  # nearly sorted already: by slot, then by when the value was made
    return recvs


def _with_comm(schedule: Schedule, rank: int, recvs: list[_Recv]) -> list[Action]:
    """Rank ``rank``'s actions with each send right after its producer and the receives at their slots."""
    n, plc = schedule.num_stages, schedule.placement
    last = n - 1
    f_cross = [s < last and plc[s + 1] != plc[s] for s in range(n)]
    b_cross = [s > 0 and plc[s - 1] != plc[s] for s in range(n)]
    new = tuple.__new__
    out: list[Action] = []
    emit = out.append
    pending: Action | None = None
    nxt = 0  # next receive to place
    total = len(recvs)
    k = 0  # compute index
    for a in schedule.ranks[rank]:
        kind = a[1]
        if pending is not None:
            emit(pending)
            pending = None
        if kind in _COMPUTE:
            while nxt < total and recvs[nxt][0] == k:
                emit(recvs[nxt][2])
                nxt += 1
            emit(a)
            s = a[0]
            if kind is _F:
                if f_cross[s]:
                    pending = new(Action, (s, _SEND_F, a[2]))
            elif kind is not _W and b_cross[s]:
                pending = new(Action, (s, _SEND_B, a[2]))
            k += 1
        else:
            emit(a)
    if pending is not None:
        emit(pending)
    out.extend(r[2] for r in recvs[nxt:])
    return out


def add_optimizer_steps(schedule: Schedule, *, at_end: bool = False) -> Schedule:
    """Insert ``STEP`` for each stage right after its ``SYNC`` (or, without one, its last B or W).

    The optimizer step of a stage can run as soon as its gradients are final
    and reduced: placing it there, in the IR, lets the validator check it
    (after all the stage's backward, one per stage) and the renderer draw it,
    and lets it overlap with the other stages' drain. Stages that already have
    a STEP keep theirs. On a complete schedule the STEP joins the run of
    communication around it, as SYNC does.

    ``at_end``: every STEP at the end of its rank's list instead (in stage
    order), after all of the rank's compute and communication: for a runtime
    that must run a collective over every rank before the first optimizer step
    (the check of non-finite values), which is deadlock-free only there.
    """
    ranks: list[list[Action]] = []
    for rank, acts in enumerate(schedule.ranks):
        stepped = {a.stage for a in acts if a.kind is Kind.STEP}
        stages = tuple(s for s in schedule.stages_of(rank) if s not in stepped)
        if not stages:
            ranks.append(list(acts))
        elif at_end:
            ranks.append([*acts, *(Action(s, Kind.STEP) for s in sorted(stages))])
        else:
            ranks.append(_insert_after_last(acts, stages, Kind.STEP))
    return schedule.with_ranks(ranks)


def forward_only(schedule: Schedule, *, validate: bool = True) -> Schedule:
    """The eval schedule of a training schedule: its F, SEND_F and RECV_F, in the same order, validated.

    Evaluation runs the forwards only; dropping B/I/W, the gradient messages,
    SYNC and STEP from each rank's list keeps every rank's forwards and
    forward messages in their training order, so the result is checked
    (completeness without backward, send/receive matching, deadlock freedom)
    rather than trusted. It is marked ``meta["forward_only"] = True``, which
    tells the validator to expect no backward work.
    """
    if schedule.meta.get("forward_only"):
        return schedule
    keep = _FORWARD_KINDS
    ranks = [[a for a in acts if a[1] in keep] for acts in schedule.ranks]
    result = schedule.with_ranks(ranks)
    result.meta["forward_only"] = True
    if validate:
        validate_schedule(result)
    return result


_FORWARD_KINDS = frozenset({Kind.F, Kind.SEND_F, Kind.RECV_F})


def lower(
    schedule: Schedule,
    *,
    split: bool = False,
    grad_sync: bool = True,
    optimizer_steps: bool = False,
    validate: bool = True,
) -> Schedule:
    """The complete, validated schedule: [split B] -> grad sync -> [optimizer steps] -> communication.

    What the runtime executes is the result, so that is what gets the full
    proof. The input is checked up front only for what the passes index by
    (stages and micro-batches in range); if a pass or the final check fails,
    the input is validated first, so a generator's bug is reported against the
    generator's own order rather than against the lowered one.
    """
    if validate and _validate_fast._check_ranges(schedule) is not None:
        validate_schedule(schedule)  # raises, naming every problem
    try:
        with gc_paused():
            result = _lower_unchecked(schedule, split=split, grad_sync=grad_sync, optimizer_steps=optimizer_steps)
        if validate:
            validate_schedule(result)
    except ScheduleError:
        if validate:
            validate_schedule(schedule)
        raise
    return result


def _lower_unchecked(schedule: Schedule, *, split: bool, grad_sync: bool, optimizer_steps: bool) -> Schedule:
    if split:
        schedule = split_backward(schedule)
    if grad_sync and not any(Kind.SYNC in set(map(_kind_of, acts)) for acts in schedule.ranks):
        schedule = add_grad_sync(schedule)
    if optimizer_steps:
        schedule = add_optimizer_steps(schedule)
    if not schedule.is_complete:
        schedule = add_communication(schedule)
    return schedule
