"""Which source the newest whole state comes from: pure, the one choice every resume and take-over makes (no torch).

A state may come back from three kinds of source: the checkpoints on disk, the snapshots in the machines' memory,
and the live tensors the surviving processes still hold. Each reports what it holds as :class:`Report` values
(the same on every process: each report comes from an exchange every process took part in), and
:func:`ranked` orders them, best first:

1. only a *whole* state can be chosen (every tensor every new stage needs); a partial one (a survivor's live
   tensors, whose lost peers' stages are elsewhere) can only complete a whole state of the same step and
   generation (:attr:`Chosen.partial`);
2. the newest *generation* first: the membership generation whose run trained the state (an in-place job's
   generations go up at each change of members; a restarted job's stay 0). A state of an older generation
   with a newer step is a branch the job gave up (its step was done again after a loss), never resumed from;
3. then the newest step;
4. a tie goes to the cheapest source: live tensors (nothing read), then the snapshots (memory), then the disk.

``sw.checkpoint.resume`` takes the first report whose restore succeeds (:mod:`.resume`); an in-place
recovery's take-over re-lays out from the live tensors and the snapshots unless the disk's state is chosen
(:mod:`..relayout.sources`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

LIVE, SNAPSHOTS, DISK = "live", "snapshots", "disk"
KINDS = (LIVE, SNAPSHOTS, DISK)  # a tie's order: nothing read, then memory, then disk


@dataclass(frozen=True)
class Report:
    """What one source holds: its kind (:data:`KINDS`), the ``step`` of a state it holds, whether that state is
    ``whole``, the membership ``generation`` that trained it, and ``holder`` (the process, for live tensors;
    the source's place in the caller's list otherwise). ``progress``: what the state's progress is at that step
    (the steps trained, the dropout step and seed, the LR schedule's place), as the source tells it: the caller
    restores the chosen report's (never part of the choice)."""

    kind: str
    step: int
    whole: bool = True
    generation: int = 0
    holder: int = 0
    progress: Any = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"a state source is one of {KINDS}, got {self.kind!r}")
        if self.step < 0 or self.generation < 0:
            raise ValueError(f"a {self.kind} source reported step {self.step}, generation {self.generation}: >= 0")


@dataclass(frozen=True)
class Chosen:
    """The whole state chosen, and the partial reports of its step and generation that may complete it."""

    report: Report
    partial: tuple[Report, ...] = ()


def ranked(reports: Iterable[Report]) -> list[Report]:
    """The whole states, best first (see the module docstring): the first is the one to restore, the next ones
    where a restore that turns out unusable hands over, in order."""
    whole = [r for r in reports if r.whole]
    return sorted(whole, key=lambda r: (-r.generation, -r.step, KINDS.index(r.kind), r.holder))


def newest(reports: Sequence[Report]) -> Chosen | None:
    """The newest whole state and the partial reports that may complete it, or None when no source holds one."""
    order = ranked(reports)
    if not order:
        return None
    best = order[0]
    partial = tuple(r for r in reports if not r.whole and (r.generation, r.step) == (best.generation, best.step))
    return Chosen(best, tuple(sorted(partial, key=lambda r: (KINDS.index(r.kind), r.holder))))
