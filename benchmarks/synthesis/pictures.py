"""Each synthesized schedule drawn under the hand-written ones on the same costs: docs/synthesis-*.png.

.venv/bin/python -m benchmarks.synthesis --pictures
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import stagewise as sw
from stagewise.ir import Schedule
from stagewise.schedules import generate
from stagewise.simulation import CostModel, simulate
from stagewise.synthesis import report_of, synthesize

from .suite import embed_head, uniform

DOCS = Path(__file__).resolve().parents[2] / "docs"


def uneven(n: int) -> CostModel:
    """Stage forwards of 1, 1.5 and 2, I : W = 3 : 1, a latency of 0.7 (the parity checks' costs)."""
    forward = tuple(1.0 + 0.5 * (s % 3) for s in range(n))
    base = uniform(n, latency=0.7)
    return replace(
        base,
        forward=forward,
        backward_input=tuple(1.5 * f for f in forward),
        backward_weight=tuple(0.5 * f for f in forward),
    )


#: (file stem, title, costs, p, m, v, placement, cap in micro-batches, hand-written schedules to draw)
CASES: list[tuple[str, str, Callable[[int], CostModel], int, int, int, str, int, tuple[str, ...]]] = [
    ("latency", "latency 30% of F, twice 1F1B's memory", lambda n: uniform(n, latency=0.3), 4, 8, 1, "loop", 8,
     ("zb-h1", "zb-h2")),
    ("embed-head", "embedding 2x and head 3x a block, 1F1B's memory", embed_head, 4, 8, 1, "loop", 4,
     ("1f1b", "zb-h1")),
    ("uneven-v2", "uneven stages, I:W = 3:1, latency 0.7, v = 2 loop, 1F1B's memory", uneven, 4, 8, 2, "loop", 4,
     ("interleaved-1f1b",)),
]  # fmt: skip


def draw(stem: str, title: str, costs: CostModel, p: int, m: int, v: int, placement: str, cap: int,
         names: tuple[str, ...]) -> Path:  # fmt: skip
    auto = synthesize(costs, p, m, memory=cap, virtual_stages=v, placement=placement)
    rep = report_of(auto)
    schedules: list[tuple[str, Schedule]] = [(n, generate(n, p, m, v)) for n in names]
    schedules.append((f"synthesized (bound {rep.lower_bound:.4g})", auto))
    timelines = [simulate(schedule, costs).timeline for _, schedule in schedules]
    titles = [f"{label}, p={p}, m={m}" for label, _ in schedules]
    target = DOCS / f"synthesis-{stem}.png"
    return sw.render.render_stack(timelines, target, titles=titles, title=title, dpi=80)  # one time scale


def draw_all() -> list[Path]:
    return [
        draw(stem, title, make(p * v), p, m, v, pl, cap, names) for stem, title, make, p, m, v, pl, cap, names in CASES
    ]
