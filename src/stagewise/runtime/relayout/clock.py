"""The seconds of each part of a re-layout (:attr:`~.layout.Layout.seconds`), lap by lap."""

from __future__ import annotations

import time


class Clock:
    """``lap(part)`` records the time since the last lap (or since the clock was made) under ``part``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.last = time.perf_counter()

    def lap(self, part: str) -> None:
        now = time.perf_counter()
        self.seconds[part] = now - self.last
        self.last = now
