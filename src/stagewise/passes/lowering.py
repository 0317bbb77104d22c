"""Lowering passes: compute-only schedule -> complete schedule the runtime can execute.

Each pass is a pure function Schedule -> Schedule. :func:`lower` chains them and
validates the result, so a generator bug surfaces as a clear error here rather
than as a hang on a cluster.
"""

from __future__ import annotations

from operator import itemgetter

from .._util import gc_paused
from ..ir import COMM, COMPUTE, Action, ActionRows, Kind, Schedule, columns, in_range, insert_after_last
from ..ir import SYNC as _SYNC_CODE
from ..ir import B as _B_CODE
from ..ir import W as _W_CODE
from ..validate import ScheduleError, dataflow_problems, validate_schedule
from ..validate import fast as _validate_fast
from . import arrays as _lower_arrays
from .reference import add_communication_reference

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
    if isinstance(schedule.ranks, ActionRows):  # columns in, columns out: no rank's row is made
        cols = insert_after_last(schedule.ranks.columns, schedule.placement, _SYNC_CODE, (_B_CODE, _W_CODE))
        if cols is not None:
            return schedule.with_ranks(ActionRows(cols))
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
    return _add_communication(schedule)


def _add_communication(schedule: Schedule) -> Schedule:
    """:func:`add_communication` of a schedule known to have no communication actions yet."""
    cols = columns(schedule)
    fast = cols is not None and in_range(cols, schedule.num_stages, schedule.num_microbatches)
    lowered = None
    if fast:
        assert cols is not None
        try:
            lowered = _lower_arrays.add_communication(cols, schedule)
        except _lower_arrays.MadeTwice:
            fast = False
    if not fast:
        # not numbers, out of range, or a value made twice: the plain pass places what it can, and the
        # validator names the fault
        timing = add_communication_reference(schedule)
        if timing is None:
            raise ScheduleError(schedule, dataflow_problems(schedule))
        result, certificate = timing
    else:
        if lowered is None:  # the order itself cannot finish: say where
            raise ScheduleError(schedule, dataflow_problems(schedule))
        out, certificate = lowered
        result = Schedule(
            schedule.name, schedule.num_microbatches, schedule.placement, ActionRows(out), dict(schedule.meta)
        )
    # the timing orders the batches: the validator checks this order instead of re-running the rendezvous
    # (stagewise.validate.arrays); not in meta, so a schedule made from this one does not inherit it
    object.__setattr__(result, "_progress_certificate", certificate)
    return result


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


def _has_sync(schedule: Schedule) -> bool:
    if isinstance(schedule.ranks, ActionRows):
        return bool((schedule.ranks.columns.kind == _SYNC_CODE).any())
    return any(Kind.SYNC in set(map(_kind_of, acts)) for acts in schedule.ranks)


def _lower_unchecked(schedule: Schedule, *, split: bool, grad_sync: bool, optimizer_steps: bool) -> Schedule:
    if split:
        schedule = split_backward(schedule)
    if grad_sync and not _has_sync(schedule):
        schedule = add_grad_sync(schedule)
    if optimizer_steps:
        schedule = add_optimizer_steps(schedule)
    if not schedule.is_complete:
        schedule = _add_communication(schedule)
    return schedule
