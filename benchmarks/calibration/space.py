"""The plan space and the seed of the held-out calibration benchmark, fixed before its first full run.

Per world size (processes on this node) the calibrating plan P and the plans Q drawn from the product below,
P excluded, by :data:`SEED`: nothing of a Q is measured before it is predicted. A plan is
``(schedule, microbatches, partition, pp, dp)``; ``pp * dp`` is the world size; the global batch is fixed
(:data:`GLOBAL_BATCH` samples), so a plan's micro-batch is ``GLOBAL_BATCH / (dp * microbatches)`` samples.
"""

from __future__ import annotations

import itertools
import random
from typing import NamedTuple

SEED = 4949
GLOBAL_BATCH = 16
SCHEDULES = ("1f1b", "gpipe", "zb-h1", "interleaved-1f1b", "zb-v")
MICROBATCHES = (4, 8)
PARTITIONS = ("uniform", "parameters", "time", "balanced")
#: (pp, dp) per world size
LAYOUTS = {2: ((2, 1),), 4: ((4, 1), (2, 2))}
#: plans Q drawn per world size (at least 30, issue 49)
DRAWN = 32


class PlanSpec(NamedTuple):
    schedule: str
    microbatches: int
    partition: str
    pp: int
    dp: int

    def describe(self) -> str:
        return f"{self.schedule} m{self.microbatches} {self.partition} pp{self.pp} dp{self.dp}"


def calibrating(world: int) -> PlanSpec:
    """P: 1F1B over every rank, 8 micro-batches, cut by the profile's times."""
    return PlanSpec("1f1b", 8, "time", world, 1)


def held_out(world: int, drawn: int = DRAWN, seed: int = SEED) -> list[PlanSpec]:
    """Q: ``drawn`` plans of the product for ``world`` (all of them if fewer), P excluded, in a seeded order."""
    if world not in LAYOUTS:
        raise ValueError(f"the plan space is defined for world sizes {sorted(LAYOUTS)}, got {world}")
    every = [
        PlanSpec(s, m, part, pp, dp)
        for (pp, dp), s, m, part in itertools.product(LAYOUTS[world], SCHEDULES, MICROBATCHES, PARTITIONS)
    ]
    every = [q for q in every if q != calibrating(world)]
    random.Random(seed + world).shuffle(every)
    return every[:drawn]
