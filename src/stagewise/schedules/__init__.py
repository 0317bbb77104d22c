"""Registered schedules: pure generators of per-rank action lists, synchronous and asynchronous.

Each schedule module registers its schedules as it loads (:func:`register`); this door loads them, in the order
the tables list them (the synchronous first), before anyone can ask the registry: every import of a module of
this package runs the door first. (The registry imports none of them: they import it.)
"""

from . import basic, interleaved, zero_bubble, dualpipe  # noqa: F401  # isort: skip  (in table order)
from .asynchronous import async_schedule, registry_minibatch, window_of
from .interleaved import microbatch_groups
from .registry import (
    ScheduleInfo,
    canonical_name,
    generate,
    is_asynchronous,
    markdown_table,
    register,
    schedule_info,
    schedule_names,
)

__all__ = [
    "ScheduleInfo",
    "async_schedule",
    "canonical_name",
    "generate",
    "is_asynchronous",
    "markdown_table",
    "microbatch_groups",
    "register",
    "registry_minibatch",
    "schedule_info",
    "schedule_names",
    "window_of",
]
