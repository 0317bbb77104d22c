"""The validator: a schedule computes every gradient once and cannot deadlock; asynchronous ones keep their
weight-version rules.

One door, :func:`validate_schedule` (and :func:`validate_versions` for asynchronous schedules). Behind it,
by role:

* :mod:`.reference`: every rule stated plainly on Action objects; it writes every :class:`ScheduleError`;
* :mod:`.fast` (a scan on flat integers) and :mod:`.arrays` (whole-array checks, progress by certificate):
  they only decide "valid or not", and property tests keep them in agreement with the reference;
* :mod:`.versions` / :mod:`.versions_fast`: the weight-version rules, stated and decided the same way.
"""

from .schedules import ScheduleError, dataflow_problems, validate_reference, validate_schedule
from .versions import async_table, validate_versions

__all__ = [
    "ScheduleError",
    "async_table",
    "dataflow_problems",
    "validate_reference",
    "validate_schedule",
    "validate_versions",
]
