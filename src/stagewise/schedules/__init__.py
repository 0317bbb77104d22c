"""Registered schedules: pure generators of per-rank action lists."""

from .registry import ScheduleInfo, generate, register, schedule_info, schedule_names

__all__ = ["ScheduleInfo", "generate", "register", "schedule_info", "schedule_names"]
