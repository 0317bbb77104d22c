"""Where a pipeline's process stands in the job: which of the schedule's action lists it runs, its rank among
all processes, the stages it holds, and which data-parallel share of a global batch it trains.

A base of :class:`~stagewise.runtime.pipeline.Pipeline`, which sets the fields when it is built (a re-layout in
place sets them again): what a user's sampler, logging or per-rank code reads, apart from how a pipeline runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .hybrid.hybrid import Hybrid


class Standing:
    """The pipeline's place among the job's processes (read-only properties)."""

    _pp_rank: int
    _num_ranks: int
    _process_rank: int
    _local_stages: tuple[int, ...]
    hybrid: Hybrid | None

    @property
    def pp_rank(self) -> int:
        """This process's rank in the pipeline, 0 to :attr:`num_ranks` - 1: which of the schedule's action
        lists it runs (the "rank" of schedules, timelines and error messages). With ``parallel=`` every
        data-parallel, sharded or tensor-parallel replica has a process at each pipeline rank, so several
        processes share it; :attr:`process_rank` tells them apart."""
        return self._pp_rank

    @property
    def rank(self) -> int:
        """:attr:`pp_rank`, the rank the schedule, the timelines and the messages speak of."""
        return self._pp_rank

    @property
    def process_rank(self) -> int:
        """This process's rank among all processes (``torch.distributed.get_rank()``), unique with ``parallel=`` too."""
        return self._process_rank

    @property
    def num_ranks(self) -> int:
        """How many ranks the pipeline runs on: the pipeline group's size (the ``pp`` degree with ``parallel=``)."""
        return self._num_ranks

    @property
    def local_stages(self) -> tuple[int, ...]:
        """The stages this process holds, in the schedule's numbering (several with virtual stages)."""
        return self._local_stages

    @property
    def replica(self) -> int:
        """Which share of a global batch this process trains, 0 to :attr:`num_replicas` - 1 (the same on every
        pipeline rank of one replica; 0 without ``parallel=``): a ``DistributedSampler``'s ``rank`` over the
        replicas, as :meth:`~stagewise.runtime.pipeline.Pipeline.local_batch` cuts a global batch."""
        return 0 if self.hybrid is None else self.hybrid.mesh.replica

    @property
    def num_replicas(self) -> int:
        """How many shares a global batch is cut into: ``dp x sharding`` with ``parallel=``, else 1."""
        return 1 if self.hybrid is None else self.hybrid.config.replicas
