"""``ParallelConfig``: the degrees of a 4-D hybrid-parallel job and the rank <-> coordinates arithmetic.

Pure: no torch. The runtime builds a named device mesh from it
(:mod:`stagewise.runtime.hybrid.mesh`).

Four mesh **axes**, outermost to innermost::

    pp        pipeline: consecutive stages, one per coordinate (least traffic: activations at the cuts)
    dp        data parallel: whole replicas, gradients all-reduced once per step
    sharding  ZeRO data parallel: replicas whose optimizer state and gradients are split between them
    tp        tensor parallel: one layer's matrices split between ranks (most traffic: every layer)

The order follows the placement advice of PaddlePaddle's 4-D hybrid guide:
the chattiest axes innermost (tensor parallel and sharding within a machine,
where links are fastest), pipeline across machines. (The guide adds data
parallel outermost; like Megatron and torchtitan, stagewise keeps the pipeline
outermost, so a pipeline's stages sit on different machines.)

A rank's coordinates are its digits in the mixed radix ``(pp, dp, sharding, tp)``::

    rank = ((pp_i * dp + dp_i) * sharding + sharding_i) * tp + tp_i

>>> c = ParallelConfig(pp=2, dp=2, tp=2)
>>> c.world_size, c.coords(5)
(8, Coords(pp=1, dp=0, sharding=0, tp=1))
>>> c.rank_of(pp=1, tp=1)
5
>>> c.axis_groups("pp")  # each group: the ranks that differ only in their pp coordinate
[(0, 4), (1, 5), (2, 6), (3, 7)]

Data: ``dp * sharding`` replicas each see their own slice of the batch
(ZeRO sharding is data parallel too); the ``tp`` ranks of a replica see the
same data.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, fields
from typing import NamedTuple

from ._util import is_count

#: the mesh axes, outermost first
AXES: tuple[str, ...] = ("pp", "dp", "sharding", "tp")


class Coords(NamedTuple):
    """A rank's place on the mesh: one coordinate per axis."""

    pp: int
    dp: int
    sharding: int
    tp: int


@dataclass(frozen=True)
class ParallelConfig:
    """Degrees of pipeline, data, sharded-data (ZeRO) and tensor parallelism; their product is the world size.

    >>> ParallelConfig(pp=2, dp=2, tp=2).check_world(6)
    Traceback (most recent call last):
    ...
    ValueError: pp=2 x dp=2 x sharding=1 x tp=2 = 8 processes, but the world has 6
    """

    pp: int = 1
    dp: int = 1
    tp: int = 1
    sharding: int = 1

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not is_count(value):
                raise ValueError(f"ParallelConfig.{f.name} must be a positive int, got {value!r}")

    # ---- sizes -----------------------------------------------------------
    @property
    def shape(self) -> tuple[int, int, int, int]:
        """The mesh shape, in :data:`AXES` order."""
        return (self.pp, self.dp, self.sharding, self.tp)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.sharding * self.tp

    @property
    def replicas(self) -> int:
        """How many slices the batch is cut into: ``dp * sharding``."""
        return self.dp * self.sharding

    def size(self, axis: str) -> int:
        return self.shape[_index(axis)]

    def describe(self) -> str:
        return " x ".join(f"{a}={n}" for a, n in zip(AXES, self.shape))

    def check_world(self, world_size: int) -> None:
        """Raise ``ValueError`` naming every factor unless their product is ``world_size``."""
        if self.world_size != world_size:
            hint = _launch_hint(self.world_size) if world_size == 1 else ""
            raise ValueError(f"{self.describe()} = {self.world_size} processes, but the world has {world_size}{hint}")

    # ---- coordinates -----------------------------------------------------
    def coords(self, rank: int) -> Coords:
        """The coordinates of ``rank`` (its mixed-radix digits, tp fastest)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the mesh {self.describe()} ({self.world_size} ranks)")
        digits = []
        for n in reversed(self.shape):
            rank, d = divmod(rank, n)
            digits.append(d)
        return Coords(*reversed(digits))

    def rank_of(self, pp: int = 0, dp: int = 0, sharding: int = 0, tp: int = 0) -> int:
        """The rank at the given coordinates (the inverse of :meth:`coords`)."""
        rank = 0
        for axis, value, n in zip(AXES, (pp, dp, sharding, tp), self.shape):
            if not 0 <= value < n:
                raise ValueError(f"coordinate {axis}={value} is outside 0..{n - 1} ({self.describe()})")
            rank = rank * n + value
        return rank

    def axis_groups(self, axis: str) -> list[tuple[int, ...]]:
        """The ranks that differ only along ``axis``, one tuple per group, ordered by their first rank."""
        k = _index(axis)
        groups: dict[tuple[int, ...], list[int]] = {}
        for rank in range(self.world_size):
            c = self.coords(rank)
            groups.setdefault(c[:k] + c[k + 1 :], []).append(rank)
        return sorted(tuple(g) for g in groups.values())

    def replica(self, rank: int) -> int:
        """Which slice of the batch ``rank`` trains on: ``dp_i * sharding + sharding_i``."""
        c = self.coords(rank)
        return c.dp * self.sharding + c.sharding


def _launch_hint(n: int) -> str:
    """A world of one is most often a script started without a launcher: how to start ``n`` processes."""
    script = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0].endswith(".py") else "your_script.py"
    return f"; start {n} processes: stagewise run -n {n} {script} (or torchrun --nproc-per-node {n} {script})"


def _index(axis: str) -> int:
    if axis not in AXES:
        raise ValueError(f"unknown mesh axis {axis!r}; the axes are {', '.join(AXES)}")
    return AXES.index(axis)
