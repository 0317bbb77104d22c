"""Wave-synchronous parallel (HetPipe, Park et al., USENIX ATC 2020): virtual workers and their clock rule.

Vocabulary. The world's ranks are cut into K *virtual workers* (VWs), each a
pipeline over its own ranks (its own stage count, partitioned for its own
devices). A *wave* is the N mini-batches a VW trains on its local weights
without hearing from the others: one window of an asynchronous schedule
(local staleness inside the window, the pipeline drains at its end), or N
synchronous steps (local staleness 0). Wave c of VW v is its *clock* c.

The rule, with W0 the initial weights, u_v^c = W_v(end of c) - W_v(start of c)
the update VW v made in wave c (whatever its optimizer did), D >= 0 the
global staleness bound and G(k) = sum_{v'} sum_{c' <= k} u_{v'}^{c'}::

    W_v(start of c+1) = W0 + (1/K) * [ G(c - D) + sum_{c' = c-D+1}^{c} u_v^{c'} ]          (pull)
    VW v starts wave c+1 only once every VW has finished wave c - D                        (bound)

and at the end of the stream every VW holds the global model W0 + (1/K) G(C - 1)
(C waves). Every update enters a VW's weights once, with the weight 1/K it has
in the global model: a VW's own recent waves early, the others' D waves later,
so a VW's view is a partial sum of the global model's and never jumps when a
late update arrives. With D = 0 and one plain-SGD mini-batch per wave,
u_v^c = -lr g_v(W(c)) and W(c+1) = W(c) - lr (1/K) sum_v g_v(W(c)): synchronous
data parallelism over K pipelines, averaged gradients.

*Lead*: when VW v starts wave c knowing every VW's updates through clock k,
it runs c - (k + 1) waves the slowest VW may not have finished yet; the bound
says lead <= D. This module is pure (no torch): the layout and the rule, with
checks that name the VW, rank and clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


class StalenessError(RuntimeError):
    """A VW would start a wave further ahead of the slowest VW than the staleness bound allows."""


@dataclass(frozen=True)
class VWLayout:
    """Which global ranks form which virtual worker: ``workers[v]`` lists VW v's ranks, stage order.

    Every rank of the world is in exactly one VW.
    """

    workers: tuple[tuple[int, ...], ...]
    world: int

    def __post_init__(self) -> None:
        if self.world < 1:
            raise ValueError(f"virtual_workers: the world must have at least 1 rank, got {self.world}")
        if not self.workers:
            raise ValueError("virtual_workers must list at least one virtual worker, e.g. [[0, 1], [2]]")
        seen: dict[int, int] = {}
        for v, ranks in enumerate(self.workers):
            if not ranks:
                raise ValueError(f"virtual_workers: VW {v} has no ranks")
            for r in ranks:
                if not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < self.world:
                    raise ValueError(
                        f"virtual_workers: VW {v} lists rank {r!r}, expected a global rank in 0..{self.world - 1}"
                    )
                if r in seen:
                    raise ValueError(f"virtual_workers: rank {r} is in VW {seen[r]} and in VW {v}; one VW per rank")
                seen[r] = v
        missing = sorted(set(range(self.world)) - set(seen))
        if missing:
            raise ValueError(
                f"virtual_workers: ranks {missing} of the world ({self.world} ranks) are in no VW; "
                "every rank must be in one"
            )

    @classmethod
    def of(cls, workers: Sequence[Sequence[int]], world: int) -> VWLayout:
        """A layout from nested lists (checked)."""
        if isinstance(workers, (str, bytes)) or not all(isinstance(w, Sequence) for w in workers):
            raise ValueError(f"virtual_workers must be a list of rank lists, e.g. [[0, 1], [2]], got {workers!r}")
        return cls(tuple(tuple(w) for w in workers), world)

    @property
    def count(self) -> int:
        """K, the number of VWs."""
        return len(self.workers)

    def worker_of(self, rank: int) -> int:
        for v, ranks in enumerate(self.workers):
            if rank in ranks:
                return v
        raise ValueError(f"rank {rank} is in no virtual worker")

    def stages(self, v: int) -> int:
        """VW v's stage count (one stage per rank)."""
        return len(self.workers[v])

    def per_rank(self, values: Sequence[float] | None, what: str, v: int) -> list[float] | None:
        """VW v's share of a per-global-rank option (``speeds``, ``memory_caps``, ...), in its stage order."""
        if values is None:
            return None
        if len(values) != self.world:
            raise ValueError(f"{what} needs one value per global rank ({self.world}), got {len(values)}")
        return [values[r] for r in self.workers[v]]


@dataclass(frozen=True)
class WaveRule:
    """The clock rule of wave-synchronous parallel with staleness bound D (see the module docstring)."""

    staleness: int

    def __post_init__(self) -> None:
        if isinstance(self.staleness, bool) or not isinstance(self.staleness, int) or self.staleness < 0:
            raise ValueError(f"staleness (the bound D, in waves) must be an integer >= 0, got {self.staleness!r}")

    def needed_before(self, wave: int) -> int:
        """The clock through which every VW's updates must be in before ``wave`` starts: wave - 1 - D (-1: none)."""
        return max(-1, wave - 1 - self.staleness)

    def own_terms(self, wave: int) -> range:
        """The clocks of a VW's own updates in its weights at the start of ``wave`` beyond the global sum."""
        return range(max(0, wave - self.staleness), wave)

    @staticmethod
    def lead(wave: int, known: int) -> int:
        """Waves a VW starting ``wave`` runs ahead of the slowest, knowing every VW's updates through ``known``."""
        return wave - (known + 1)

    def check_start(self, vw: int, wave: int, known: int) -> int:
        """The lead of VW ``vw`` starting ``wave``; :class:`StalenessError` if it exceeds the bound."""
        lead = self.lead(wave, known)
        if lead > self.staleness:
            raise StalenessError(
                f"VW {vw} would start wave {wave} knowing every VW's updates only through wave {known}: "
                f"{lead} waves ahead of the slowest VW, but the staleness bound is D={self.staleness}"
            )
        return lead


def check_clocks(clocks: Sequence[float], expected: int, layout: VWLayout) -> None:
    """The clock slots of the reduction of wave ``expected`` (rank r wrote ``clock + 1`` into slot r): each rank
    must have pushed exactly that wave."""
    wrong = [(r, int(round(c)) - 1) for r, c in enumerate(clocks) if int(round(c)) != expected + 1]
    if wrong:
        said = ", ".join(f"rank {r} (VW {layout.worker_of(r)}) wave {c}" for r, c in wrong)
        raise RuntimeError(f"the reduction of wave {expected} mixes waves: {said}; every VW must push once per wave")


def check_more(flags: Sequence[float], wave: int, layout: VWLayout) -> bool:
    """Whether a wave follows ``wave``, which every rank must agree on (rank r wrote 1 or 0 into slot r)."""
    more = {int(round(f)) for f in flags}
    if len(more) > 1:
        going = sorted({layout.worker_of(r) for r, f in enumerate(flags) if round(f) == 1})
        ending = sorted({layout.worker_of(r) for r, f in enumerate(flags) if round(f) == 0})
        raise ValueError(
            f"the VWs' streams end at different waves: VWs {ending} end after wave {wave}, VWs {going} go on; "
            "every VW must run as many waves: give each as many mini-batches (with a wave size per VW, wave=[...], "
            "each VW's stream holds its own wave size per wave)"
        )
    return more == {1}


__all__ = ["StalenessError", "VWLayout", "WaveRule", "check_clocks", "check_more"]
