"""What every multi-process check module shares: the context a check runs in."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Ctx:
    """A check's rank and world size; ``group``: the pipeline group (None = WORLD)."""

    rank: int
    world: int
    group: Any = None
