"""Lowering passes: compute-only schedule -> complete schedule the runtime can execute.

Each pass is a pure function Schedule -> Schedule. :func:`lower` chains them and
validates the result, so a generator bug surfaces as a clear error here rather
than as a hang on a cluster.
"""

from __future__ import annotations

from bisect import bisect_left

from .actions import Action, Kind
from .dataflow import consumer_stage, consumes, produces, recv_action, send_action
from .schedule import Schedule
from .validate import ScheduleError, dataflow_problems, validate_schedule


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
    ranks = []
    for acts in schedule.ranks:
        last: dict[int, int] = {}
        for idx, a in enumerate(acts):
            if a.kind is Kind.B or a.kind is Kind.W:
                last[a.stage] = idx
        syncs_after: dict[int, list[int]] = {}
        for stage, idx in last.items():
            syncs_after.setdefault(idx, []).append(stage)
        out: list[Action] = []
        for idx, a in enumerate(acts):
            out.append(a)
            for stage in sorted(syncs_after.get(idx, ())):
                out.append(Action(stage, Kind.SYNC))
        ranks.append(out)
    return schedule.with_ranks(ranks)


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
    if any(a.kind.is_comm for acts in schedule.ranks for a in acts):
        raise ValueError(f"schedule {schedule.name!r} already has communication actions")
    from .simulate import simulate

    problems = dataflow_problems(schedule)
    if problems:  # the order itself cannot finish: say where, before timing it
        raise ScheduleError(schedule, problems)
    n, placement = schedule.num_stages, schedule.placement
    timed = simulate(schedule.compute_only())  # its actions per rank are exactly the compute actions
    # boundary k of a rank is the slot just before its k-th compute action (k = count: the end)
    compute_index: list[dict[int, int]] = []  # rank -> {action list index: compute index}
    made_at: dict[object, tuple[float, int, int]] = {}  # message -> (time made, producer rank, compute index)
    for rank, acts in enumerate(schedule.ranks):
        mapping = {}
        k = 0
        for idx, a in enumerate(acts):
            if a.kind.is_compute:
                mapping[idx] = k
                made = produces(a, n)
                if made is not None and placement[consumer_stage(made)] != rank:
                    made_at[made] = (timed.ends[rank][k], rank, k)
                k += 1
        compute_index.append(mapping)
    recvs_at: list[dict[int, list[tuple[tuple[float, int, int], Action]]]] = [{} for _ in schedule.ranks]
    for rank, acts in enumerate(schedule.ranks):
        starts = timed.starts[rank]
        for idx, a in enumerate(acts):
            if not a.kind.is_compute:
                continue
            need = consumes(a, n)
            if need is None or placement[need.stage] == rank:
                continue
            when = made_at[need]
            consumer = compute_index[rank][idx]
            slot = min(bisect_left(starts, when[0]), consumer)
            recvs_at[rank].setdefault(slot, []).append((when, recv_action(need)))
    ranks = []
    for rank, acts in enumerate(schedule.ranks):
        out: list[Action] = []
        pending_sends: list[Action] = []
        k = 0
        for a in acts:
            if a.kind.is_compute:
                out += pending_sends
                pending_sends = []
                out += [r for _, r in sorted(recvs_at[rank].get(k, ()))]
                out.append(a)
                made = produces(a, n)
                if made is not None and placement[consumer_stage(made)] != rank:
                    pending_sends.append(send_action(made))
                k += 1
            else:
                out += pending_sends
                pending_sends = []
                out.append(a)
        out += pending_sends
        out += [r for _, r in sorted(recvs_at[rank].get(k, ()))]
        ranks.append(out)
    return schedule.with_ranks(ranks)


def lower(schedule: Schedule, *, split: bool = False, grad_sync: bool = True, validate: bool = True) -> Schedule:
    """The complete, validated schedule: [split B] -> grad sync -> communication."""
    if split:
        schedule = split_backward(schedule)
    if validate:
        validate_schedule(schedule)
    if grad_sync and not any(a.kind is Kind.SYNC for acts in schedule.ranks for a in acts):
        schedule = add_grad_sync(schedule)
    if not schedule.is_complete:
        schedule = add_communication(schedule)
    if validate:
        validate_schedule(schedule)
    return schedule
