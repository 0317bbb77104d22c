"""Lowering passes: compute-only schedule -> complete schedule the runtime can execute.

Each pass is a pure function Schedule -> Schedule. :func:`lower` chains them and
validates the result, so a generator bug surfaces as a clear error here rather
than as a hang on a cluster.
"""

from __future__ import annotations

from .actions import Action, Kind
from .dataflow import consumes, produces, recv_action, send_action
from .schedule import Schedule


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

    Between two compute actions c1, c2 of a rank the pass puts one batch:
    the sends of what c1 produced, then the receives c2 needs. Posting a
    batch together is what lets 1F1B's steady state exchange "send forward,
    receive backward" with its neighbour without a rendezvous deadlock.
    """
    if any(a.kind.is_comm for acts in schedule.ranks for a in acts):
        raise ValueError(f"schedule {schedule.name!r} already has communication actions")
    n = schedule.num_stages
    placement = schedule.placement
    ranks = []
    for rank, acts in enumerate(schedule.ranks):
        out: list[Action] = []
        for a in acts:
            if a.kind.is_compute:
                need = consumes(a, n)
                if need is not None and placement[need.stage] != rank:
                    out.append(recv_action(need))
                out.append(a)
                made = produces(a, n)
                if made is not None and placement[a.stage + (1 if made.direction == "F" else -1)] != rank:
                    out.append(send_action(made))
            else:
                out.append(a)
        ranks.append(out)
    return schedule.with_ranks(ranks)


def lower(schedule: Schedule, *, split: bool = False, grad_sync: bool = True, validate: bool = True) -> Schedule:
    """The complete, validated schedule: [split B] -> grad sync -> communication."""
    from .validate import validate_schedule

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
