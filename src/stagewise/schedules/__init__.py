"""Registered schedules: pure generators of per-rank action lists, synchronous and asynchronous."""

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
