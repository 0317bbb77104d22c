"""Pausing the cyclic garbage collector around passes that allocate millions of acyclic objects."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


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
