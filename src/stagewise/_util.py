"""Small helpers of the pure core: predicates for counts and finite numbers, and the garbage collector paused around
big passes."""

from __future__ import annotations

import gc
import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TypeGuard

#: stagewise's version (``stagewise.__version__``; the installed distribution's, as pip reports it, is the same)
VERSION = "0.2.0"


def is_count(value: object, least: int = 1) -> TypeGuard[int]:
    """Whether ``value`` is an int (not a bool, which Python counts as one) of at least ``least``.

    Each caller words its own error."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def is_finite_number(value: object, least: float = -math.inf) -> TypeGuard[float]:
    """Whether ``value`` is a finite int or float (not a bool) of at least ``least``. Each caller words its own
    error."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and least <= value < math.inf


@contextmanager
def gc_paused() -> Iterator[None]:
    """Why: lowering 128 ranks x 1024 micro-batches makes ~1-2 M actions (tuples holding an enum member,
    so tracked by the collector); the collections their allocation triggers re-scan everything already
    made and, measured, more than double the time of the passes. Nothing they make is cyclic."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
