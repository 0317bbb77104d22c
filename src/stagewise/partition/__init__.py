"""Partitioning: how many layers each stage gets, as arithmetic on cost vectors (no torch, no measurement).

* :mod:`.cut`: the exact min-max cut of a cost vector under memory caps (:func:`partition_costs`);
* :mod:`.modes`: the partition modes every frontend shares (``"balanced"``, ``"uniform"``, ``"parameters"``, ``"time"``,
  ``"memory"``, explicit counts) and their one set of messages (:func:`stage_counts`);
* :mod:`.estimate`: the default ``"balanced"`` cut, from work counted rather than timed (:func:`balanced_counts`);
* :mod:`.profile_data`: a measured layer profile as plain data (:class:`LayerProfile`).
"""

from .cut import Partition, partition_costs, uniform_counts
from .estimate import CountedLayer, Rates, balanced_counts, estimated_profile, parameters_as_work
from .modes import (
    PartitionSpec,
    check_options,
    counts_to_ranges,
    layer_memory,
    needs_profile,
    stage_counts,
    stages_per_rank_note,
)
from .profile_data import CheckpointCost, LayerCost, LayerProfile, shared_bytes

__all__ = [
    "CountedLayer",
    "Rates",
    "balanced_counts",
    "estimated_profile",
    "parameters_as_work",
    "CheckpointCost",
    "LayerCost",
    "LayerProfile",
    "shared_bytes",
    "Partition",
    "PartitionSpec",
    "check_options",
    "counts_to_ranges",
    "layer_memory",
    "needs_profile",
    "partition_costs",
    "stage_counts",
    "stages_per_rank_note",
    "uniform_counts",
]
