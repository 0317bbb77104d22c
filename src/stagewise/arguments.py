"""Checks shared by the validation of plain arguments (each caller words its own error)."""

from __future__ import annotations

from typing import TypeGuard


def is_count(value: object, least: int = 1) -> TypeGuard[int]:
    """Whether ``value`` is an int (not a bool, which Python counts as one) of at least ``least``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= least
