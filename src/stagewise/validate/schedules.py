"""The validator's door for every schedule: the fast path decides, the reference names the problems.

The rules, and how each fast path is checked against them, are listed once in :mod:`stagewise.validate`;
they are stated in :mod:`.reference`. :func:`validate_schedule` asks :mod:`.fast` (seconds at 128 ranks x
1024 micro-batches), and when it finds a problem, the reference lists every problem of the first broken
rule with its rank, action and neighbours.
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
