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
from typing import NamedTuple, Protocol

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


@dataclass(frozen=True)
class Fit:
    """What an :class:`ElasticLayout` makes of one world size: the mesh and the micro-batches of each replica."""

    world: int
    parallel: ParallelConfig
    microbatches: int
    microbatch_size: int

    def describe(self) -> str:
        """``pp 2 x dp 3`` (the axes of degree 1 left out, pp always named)."""
        return short(self.parallel)


class Job(Protocol):
    """What :meth:`ElasticLayout.at` reads of ``sw.init()``'s result: this round's size and every size the job
    may take (``stagewise run -n N --nnodes MIN:MAX``: N times MIN..MAX)."""

    @property
    def world_size(self) -> int: ...

    @property
    def world_sizes(self) -> tuple[int, ...]: ...


@dataclass(frozen=True)
class ElasticLayout:
    """A layout that follows the world size: ``pp`` (and ``tp``, ``sharding``) fixed, data parallelism over
    whatever processes are left, and the global batch of ``batch`` rows kept at every size.

    Give the rows per micro-batch (``microbatch_size``: the micro-batches per replica adjust) or the
    micro-batches per replica (``microbatches``: their rows adjust). A world size the layout cannot use is
    refused at once, naming the sizes it can use; given the job (``layout.at(sw.init())``), every size the
    job may take is checked at the start, not only the size of this round.

    >>> layout = ElasticLayout(pp=2, batch=24, microbatch_size=2)
    >>> layout.at(6).describe(), layout.at(6).microbatches, layout.at(4).microbatches
    ('pp 2 x dp 3', 4, 6)
    >>> layout.sizes()
    (2, 4, 6, 8, 12, 24)
    >>> try:
    ...     layout.at(10)
    ... except ValueError as err:
    ...     print(err)  # doctest: +NORMALIZE_WHITESPACE
    ElasticLayout(pp=2, batch=24, microbatch_size=2) cannot use 10 processes (pp 2 x dp 5: 24 rows do not split
    into 5 replicas); it can use 2, 4, 6, 8, 12 or 24 processes
    """

    pp: int
    batch: int
    microbatch_size: int | None = None
    microbatches: int | None = None
    tp: int = 1
    sharding: int = 1

    def __post_init__(self) -> None:
        for name in ("pp", "batch", "tp", "sharding"):
            if not is_count(getattr(self, name)):
                raise ValueError(f"ElasticLayout.{name} must be a positive int, got {getattr(self, name)!r}")
        if (self.microbatch_size is None) == (self.microbatches is None):
            raise ValueError(
                "ElasticLayout needs one of microbatch_size= (rows per micro-batch: the micro-batches adjust) or "
                "microbatches= (micro-batches per replica: their rows adjust)"
            )
        for name in ("microbatch_size", "microbatches"):
            value = getattr(self, name)
            if value is not None and not is_count(value):
                raise ValueError(f"ElasticLayout.{name} must be a positive int, got {value!r}")

    @property
    def fixed(self) -> int:
        """Processes per replica: ``pp * sharding * tp`` (the world is a multiple of it)."""
        return self.pp * self.sharding * self.tp

    def at(self, world: int | Job) -> Fit:
        """The layout at ``world`` processes; ``ValueError`` naming the sizes it can use if it cannot. Given the
        job (``sw.init()``'s result), every size in its ``world_sizes`` is checked first, this round's among them.
        """
        if not isinstance(world, int):
            sizes = tuple(world.world_sizes) or (world.world_size,)
            for size in (world.world_size, *sizes):
                self._refuse(
                    size,
                    "" if size == world.world_size else f", which this job may reach (its sizes: {_listed(sizes)})",
                )
            world = world.world_size
        self._refuse(world, "")
        config = ParallelConfig(pp=self.pp, dp=world // self.fixed, tp=self.tp, sharding=self.sharding)
        rows = self.batch // config.replicas
        m = self.microbatches if self.microbatches is not None else rows // (self.microbatch_size or 1)
        return Fit(world, config, m, rows // m)

    def _refuse(self, world: int, which: str) -> None:
        why = self._unusable(world)
        if not why:
            return
        sizes = self.sizes()
        if not sizes:
            raise ValueError(f"{self._name()} cannot use any number of processes: {self._unusable(self.fixed)}")
        raise ValueError(
            f"{self._name()} cannot use {world} processes{which} ({why}); it can use {_listed(sizes)} processes"
        )

    def sizes(self) -> tuple[int, ...]:
        """Every world size the layout can use (a whole number of replicas, each with whole micro-batches)."""
        return tuple(dp * self.fixed for dp in range(1, self.batch + 1) if not self._unusable(dp * self.fixed))

    def _unusable(self, world: int) -> str:
        """Why ``world`` processes cannot run this layout ("" if they can)."""
        if not is_count(world):
            return "the world size must be a positive int"
        if world % self.fixed:
            return f"not a multiple of pp {self.pp} x sharding {self.sharding} x tp {self.tp} = {self.fixed}"
        dp = world // self.fixed
        replicas = dp * self.sharding
        what = f"pp {self.pp} x dp {dp}"
        if self.batch % replicas:
            return f"{what}: {self.batch} rows do not split into {replicas} replicas"
        rows = self.batch // replicas
        unit = self.microbatch_size if self.microbatch_size is not None else self.microbatches
        assert unit is not None
        if rows % unit:
            whole = f"whole micro-batches of {unit} rows" if self.microbatch_size else f"{unit} whole micro-batches"
            return f"{what}: {self.batch} rows do not split into {replicas} replicas of {whole}"
        return ""

    def _name(self) -> str:
        given = [f"pp={self.pp}", f"batch={self.batch}"]
        given += [f"{n}={getattr(self, n)}" for n in ("microbatch_size", "microbatches") if getattr(self, n)]
        given += [f"{n}={getattr(self, n)}" for n in ("tp", "sharding") if getattr(self, n) > 1]
        return f"ElasticLayout({', '.join(given)})"


def _listed(sizes: tuple[int, ...]) -> str:
    """``2, 4 or 8``."""
    words = [str(s) for s in sizes]
    return ", ".join(words[:-1]) + f" or {words[-1]}" if len(words) > 1 else words[0]


#: ``MIN:MAX`` of ``stagewise run --nnodes``, in every worker's environment (:func:`world_sizes`)
NNODES_ENV = "STAGEWISE_NNODES"


def world_sizes(nnodes: str, nproc: int, world: int) -> tuple[int, ...]:
    """The world sizes a job may take: ``nproc`` (per machine) times MIN..MAX for ``nnodes`` = ``"MIN:MAX"``,
    else ``(world,)`` (not elastic, or not said).

    >>> world_sizes("2:3", 8, 16), world_sizes("", 4, 4)
    ((16, 24), (4,))
    """
    low, sep, high = nnodes.partition(":")
    if not sep or not low.isdigit() or not high.isdigit() or nproc < 1 or int(low) > int(high):
        return (world,)
    return tuple(nproc * k for k in range(int(low), int(high) + 1))


def short(config: ParallelConfig) -> str:
    """``pp 2 x dp 3``: the mesh's degrees in words, those of 1 left out (pp always named)."""
    named = [(a, n) for a, n in zip(AXES, config.shape) if n > 1 or a == "pp"]
    return " x ".join(f"{a} {n}" for a, n in named)
