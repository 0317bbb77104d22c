"""The validator: proves a schedule computes every gradient once and cannot deadlock.

Checks, in order (each error names the rank and prints the offending actions):

1. placement: every action runs on the rank that holds its stage;
2. completeness: each (stage, micro-batch) has exactly one F and one backward
   (a B, or an I and a W), and nothing else; a forward-only (eval) schedule,
   marked ``meta["forward_only"]``, has exactly one F and no backward;
3. local order: on a rank, backward after its own F, I before W, and across
   two stages held by the same rank, data order (F of s-1 before F of s, ...);
4. optimizer steps: if the schedule has STEP actions, each stage has exactly
   one, after all of the stage's compute and its SYNC; a forward-only schedule
   has neither SYNC nor STEP;
5. communication (complete schedules): every value crossing ranks is sent once
   after it is made and received once before it is used, and on each
   (sender, receiver) channel the k-th send is the k-th receive;
6. progress: executing all ranks together with *blocking* point-to-point can
   finish. Maximal runs of communication actions are posted as one batch (as
   ``batch_isend_irecv`` does) and a batch completes once every operation in it
   has met its partner (rendezvous). Compute-only schedules are checked as pure
   data flow instead.

Two implementations prove these facts: a fast one on flat integer arrays
(:mod:`stagewise.validate.fast`, seconds at 128 ranks x 1024 micro-batches)
decides, and when it finds a problem the straightforward reference
(:mod:`stagewise.validate.reference`) lists every problem with its rank,
action and neighbours. A property test keeps the two in agreement.
"""

from __future__ import annotations

from .._util import gc_paused
from ..ir import Schedule
from . import fast as _validate_fast
from .reference import dataflow_problems, reference_problems

__all__ = ["ScheduleError", "dataflow_problems", "validate_reference", "validate_schedule"]

_MAX_SHOWN = 8


class ScheduleError(ValueError):
    """A schedule that would compute wrong gradients, or hang."""

    def __init__(self, schedule: Schedule, problems: list[str]) -> None:
        self.problems = problems
        shown = problems[:_MAX_SHOWN]
        more = f"\n  ... and {len(problems) - _MAX_SHOWN} more" if len(problems) > _MAX_SHOWN else ""
        super().__init__(
            f"schedule {schedule.name!r} ({schedule.num_ranks} ranks, {schedule.num_stages} stages, "
            f"{schedule.num_microbatches} micro-batches) is invalid:\n  " + "\n  ".join(shown) + more
        )


def validate_schedule(schedule: Schedule) -> None:
    """Raise :class:`ScheduleError` listing every problem found; return None if valid.

    A schedule object that passed once is remembered as valid (schedules are
    immutable), so validating it again, e.g. when a rank resolves the schedule
    it was handed, costs nothing.
    """
    mode = bool(schedule.meta.get("forward_only", False))  # the one mutable fact validity depends on
    if schedule.__dict__.get("_validated_as") == mode:
        return
    with gc_paused():
        problem = _validate_fast.first_problem(schedule)
    if problem is not None:
        # the reference names every problem; if it found none, the fast path's own words stand
        raise ScheduleError(schedule, reference_problems(schedule) or [problem])
    object.__setattr__(schedule, "_validated_as", mode)


def validate_reference(schedule: Schedule) -> None:
    """The same verdict as :func:`validate_schedule`, by the straightforward checks (slow on large schedules)."""
    problems = reference_problems(schedule)
    if problems:
        raise ScheduleError(schedule, problems)
