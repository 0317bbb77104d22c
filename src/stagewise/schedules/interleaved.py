"""Interleaved (virtual-stage) schedules."""
