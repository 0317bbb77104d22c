"""Timelines: what ran where and when — shared by the simulator, the runtime and the renderers."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from .actions import Action, parse_action


@dataclass(frozen=True, slots=True)
class Event:
    """Rank ``rank`` executed ``action`` from ``start`` to ``end`` (seconds, or cost units when simulated)."""

    rank: int
    action: Action
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass
class Timeline:
    """The events of one pipeline step, simulated or measured; renderers take this and nothing else."""

    name: str
    num_ranks: int
    events: list[Event]
    source: str = "simulated"  # or "measured"
    unit: str = "s"
    meta: dict[str, object] = field(default_factory=dict)

    @property
    def makespan(self) -> float:
        if not self.events:
            return 0.0
        return max(e.end for e in self.events) - min(e.start for e in self.events)

    def busy(self, rank: int) -> float:
        """Time rank ``rank`` spent in compute actions."""
        return sum(e.duration for e in self.events if e.rank == rank and e.action.kind.is_compute)

    @property
    def bubble_ratio(self) -> float:
        """Idle share of (ranks x makespan), counting only compute as busy."""
        span = self.makespan
        if span <= 0:
            return 0.0
        busy = sum(e.duration for e in self.events if e.action.kind.is_compute)
        return 1.0 - busy / (self.num_ranks * span)

    def by_rank(self) -> list[list[Event]]:
        rows: list[list[Event]] = [[] for _ in range(self.num_ranks)]
        for e in self.events:
            rows[e.rank].append(e)
        for row in rows:
            row.sort(key=lambda e: e.start)
        return rows

    def to_json(self) -> dict[str, object]:
        return {
            "name": self.name,
            "num_ranks": self.num_ranks,
            "source": self.source,
            "unit": self.unit,
            "meta": self.meta,
            "events": [[e.rank, str(e.action), e.start, e.end] for e in self.events],
        }

    @classmethod
    def from_json(cls, data: dict[str, object]) -> Timeline:
        raw = data["events"]
        assert isinstance(raw, list)
        events = [Event(int(r), parse_action(str(a)), float(s), float(e)) for r, a, s, e in raw]
        return cls(
            name=str(data["name"]),
            num_ranks=int(data["num_ranks"]),  # type: ignore[call-overload]
            events=events,
            source=str(data.get("source", "simulated")),
            unit=str(data.get("unit", "s")),
            meta=dict(data.get("meta", {})),  # type: ignore[call-overload]
        )

    def dumps(self) -> str:
        return json.dumps(self.to_json())


def merge(timelines: Sequence[Timeline] | Iterable[Timeline], name: str | None = None) -> Timeline:
    """Join per-rank measured timelines (one per process) into one."""
    timelines = list(timelines)
    if not timelines:
        raise ValueError("merge needs at least one timeline")
    events = [e for t in timelines for e in t.events]
    first = timelines[0]
    return Timeline(
        name=name or first.name,
        num_ranks=max(t.num_ranks for t in timelines),
        events=sorted(events, key=lambda e: (e.rank, e.start)),
        source=first.source,
        unit=first.unit,
        meta=dict(first.meta),
    )
