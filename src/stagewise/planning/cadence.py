"""Which steps a settled run is watched on (issue 49 item 4: what watching a run costs).

Watching a step (its events sent to the lead, decoded, calibrated, a sync of the ranks) cost 3-12 ms of a 106-120 ms
step on 2026-12-04 (``benchmarks.watch_cost``), on every step, though most steps of a settled run say nothing new:
the same cut, the same speeds, no rank on the other side of its line. So once a run is settled, for
:attr:`Cadence.settle` watched steps running, one step in :attr:`Cadence.every` is watched; any step that says
something (a calibration still to make, a rank read slow that is not named or read fast that is, the calibration's
news, a probe that found something, a decision taken) watches every step again. A slowdown that begins on a
step not watched is read at most ``every - 1`` steps late, and named after :data:`~.stragglers.WINDOW` //2 + 1 slow
readings more, every step watched by then: within ``every + 2`` steps of its first slow step (5 at the default 3,
the issue's bar).

Every rank keeps the same cadence: with a lead the lead's last word for a watched step says the next one; every
rank watching alike computes it from the same readings.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from .stragglers import RECOVERED, SLOW, WINDOW, Detector

#: the default: one step in this many is watched once a run is settled (a slowdown named within 5 steps)
SETTLED_EVERY = 3


@dataclass
class Cadence:
    """The next step watched: every step until :attr:`settle` watched steps running were quiet, then one in
    :attr:`every` until one is not (``every`` 1: every step, always)."""

    every: int = SETTLED_EVERY
    settle: int = WINDOW
    #: watched steps running that said nothing new
    quiet: int = 0
    #: the next step to watch (a step number as the pipeline counts its train steps)
    next: int = 0

    def __post_init__(self) -> None:
        if self.every < 1 or self.settle < 0:
            raise ValueError(f"Cadence: every must be >= 1 and settle >= 0, got {self.every}, {self.settle}")

    def due(self, step: int) -> bool:
        """Whether ``step`` (just trained) is watched."""
        return step >= self.next

    def after(self, step: int, quiet: bool) -> int:
        """Record a watched ``step`` (``quiet``: it said nothing new); the next step to watch, returned."""
        self.quiet = self.quiet + 1 if quiet else 0
        self.next = step + (self.every if self.quiet >= self.settle else 1)
        return self.next

    @property
    def settled(self) -> bool:
        """Whether the watch has relaxed to one step in :attr:`every`."""
        return self.quiet >= self.settle and self.every > 1


def readings_settled(detector: Detector, capped: Sequence[bool] = ()) -> bool:
    """Whether ``detector``'s last reading of every rank agrees with what it holds of the rank: a full window; the
    reading (relative to the step's fastest) not slow (under :data:`~.stragglers.SLOW`) for a rank not named, not
    recovered (over :data:`~.stragglers.RECOVERED`) for a named one, and within :data:`~.stragglers.SLOW` of the
    median of the rank's window before it either way (a named rank slowed further, or half back). A reading on the
    other side is what the next steps confirm or not, so they are watched. A ``capped`` rank (its cap probed: a
    held rank the re-cut left little work reads alike capped or not) is watched by its probes, not its readings."""
    for r, history in enumerate(detector.history):
        if len(history) < WINDOW:
            return False
        if r < len(capped) and capped[r]:
            continue
        last, before = history[-1], statistics.median(history[:-1])
        if (last > RECOVERED) if r in detector.named else (last < SLOW):
            return False
        if not before * SLOW <= last <= before / SLOW:
            return False
    return True
