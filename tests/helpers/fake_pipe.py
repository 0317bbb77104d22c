"""What the Replanner reads of a pipeline, without one: a schedule, its cut, and a re-cut that only re-counts
(the Replanner's tests on synthetic timelines: tests/runtime/test_replanner_*.py)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any


class FakePipe(SimpleNamespace):
    """``schedule`` cut by ``counts`` (layers per rank), ``layer_profile`` as given (None: the flat prior);
    :meth:`relayout` re-cuts. Subclasses give the steps."""

    def __init__(self, schedule: Any, counts: list[int], layer_profile: Any, **more: Any) -> None:
        super().__init__(
            schedule=schedule,
            layer_ranges=[],
            layer_profile=layer_profile,
            num_ranks=schedule.num_ranks,
            rank=0,
            train_steps=0,
            metrics=SimpleNamespace(event=lambda *a, **k: None),
            **more,
        )
        self.relayout(counts)

    def relayout(self, partition: list[int], **_: Any) -> None:
        edges = [0]
        for c in partition:
            edges.append(edges[-1] + c)
        self.layer_ranges = [range(a, b) for a, b in zip(edges, edges[1:])]
