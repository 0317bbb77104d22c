"""Partition modes: how many layers (or blocks) each stage holds, decided one way for every frontend.

Layer lists, ``from_model``'s top-level blocks and ``split_model`` all come
here, so a mode means the same thing and fails with the same message
everywhere. Pure: the numbers come from the caller (parameter counts) or a
:class:`~stagewise.LayerProfile`; the exact min-max cut is
:func:`stagewise.partition.cut.partition_costs`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Union

from .cut import partition_costs, uniform_counts
from .estimate import balanced_counts
from .profile_data import LayerProfile

#: a partition mode by name, or layer counts per stage
PartitionSpec = Union[str, Sequence[int]]  # noqa: UP007

#: the partition modes that choose cut points themselves (besides explicit counts per stage)
PARTITIONS = ("balanced", "uniform", "parameters", "time", "memory")

#: the default mode: costs counted, not timed (:mod:`.estimate`)
DEFAULT = "balanced"


def needs_profile(how: PartitionSpec, memory_caps: Sequence[float] | None = None) -> bool:
    """Whether ``how`` (with ``memory_caps``) decides from measured costs; raises for an unknown mode."""
    if isinstance(how, str) and how not in PARTITIONS:
        raise ValueError(
            "partition must be 'balanced', 'uniform', 'parameters', 'time', 'memory' or a list of layer counts, "
            f"got {how!r}"
        )
    return how in ("time", "memory") or (isinstance(how, str) and memory_caps is not None)


def layer_memory(profile: LayerProfile, in_flight: int = 1) -> list[float]:
    """Bytes each layer makes its stage hold: weights and their gradients, and the activations of
    ``in_flight`` micro-batches (optimizer state is not counted); the last layer's stage holds what the loss
    keeps (``loss_bytes``) for as many."""
    held = [2 * c.parameter_bytes + in_flight * c.activation_bytes for c in profile.layers]
    if held:
        held[-1] += in_flight * profile.loss_bytes
    return held


def stage_counts(
    n: int,
    num_stages: int,
    how: PartitionSpec = "uniform",
    *,
    parameters: Callable[[], Sequence[float]] | None = None,
    profile: LayerProfile | None = None,
    speeds: Sequence[float] | None = None,
    memory_caps: Sequence[float] | None = None,
    in_flight: int = 1,
    unit: str = "layer",
    times: Sequence[float] | None = None,
    placement: Sequence[int] | None = None,
) -> list[int]:
    """How many of ``n`` units (layers, blocks) each stage holds; contiguous, none empty.

    * ``"balanced"`` (the default): the min-max cut of ``times`` (costs counted on the meta device,
      :mod:`.estimate`), else of ``parameters()``, kept even where the even cut is as good
      (:func:`.estimate.balanced_counts`, with ``placement``: stage -> rank); even without either;
    * ``"uniform"``: equal counts, the first stages take the remainder;
    * ``"parameters"``: the least possible largest parameter count (``parameters()``, one per unit);
    * ``"time"``: the least possible slowest stage, by the profile's forward + backward times;
    * ``"memory"``: the least possible largest :func:`layer_memory` (profile bytes);
    * a list of counts per stage.

    ``speeds`` (one per stage) divides a stage's time or parameter count, so a
    stage at half speed gets about half the work (HetPipe's heterogeneous
    devices); ``memory_caps`` (bytes, one per stage) forbids a stage whose
    :func:`layer_memory` exceeds its cap. Both are solved exactly by
    :func:`stagewise.partition.cut.partition_costs`; an infeasible cap raises.
    ``times`` (one per unit) replaces the profile's times for ``"time"``.
    """
    check_options(n, num_stages, how, speeds, memory_caps, unit)
    if not isinstance(how, str):
        return [int(c) for c in how]
    if how == "uniform":
        return uniform_counts(n, num_stages)
    if how == DEFAULT and memory_caps is None:
        return _balanced(n, num_stages, times, parameters, placement, speeds, unit)
    if how == "time" and times is not None and memory_caps is None:
        if len(times) != n:
            raise ValueError(f"costs has {len(times)} entries, expected one per {unit} ({n})")
        return partition_costs([float(t) for t in times], num_stages, speeds=speeds).counts
    memory = _profiled_memory(n, how, profile, memory_caps, in_flight, unit)
    if how == "parameters":
        if parameters is None:
            raise ValueError("partition='parameters' needs the parameter counts")
        costs = [float(c) for c in parameters()]
    elif how in ("time", DEFAULT):  # "balanced" with memory caps: the measured times, capped
        costs = profile.times()  # type: ignore[union-attr]
    else:
        costs = memory  # type: ignore[assignment]
    caps = None if memory_caps is None else list(memory_caps)
    try:
        cut = partition_costs(costs, num_stages, speeds=speeds, memory=memory if caps else None, memory_caps=caps)
    except ValueError as err:
        raise ValueError(
            f"{err}; a {unit} holds 2 x its parameter bytes + {in_flight} micro-batch(es) of its activations"
        ) from err
    return cut.counts


def _profiled_memory(
    n: int, how: str, profile: LayerProfile | None, memory_caps: Sequence[float] | None, in_flight: int, unit: str
) -> list[float] | None:
    """Each unit's :func:`layer_memory` (None without a profile), once the profile is checked to be there when
    ``how`` or ``memory_caps`` needs it, with one entry per unit."""
    if needs_profile(how, memory_caps) and profile is None:
        extra = " with memory_caps=" if memory_caps is not None else ""
        raise ValueError(f"partition={how!r}{extra} needs a profile of the {unit}s (one micro-batch of sample inputs)")
    if profile is not None and len(profile) != n:
        raise ValueError(f"the profile has {len(profile)} entries, but there are {n} {unit}s")
    return layer_memory(profile, in_flight) if profile is not None else None


def _balanced(
    n: int,
    num_stages: int,
    times: Sequence[float] | None,
    parameters: Callable[[], Sequence[float]] | None,
    placement: Sequence[int] | None,
    speeds: Sequence[float] | None,
    unit: str,
) -> list[int]:
    """``"balanced"``: counted costs, else parameter counts, else the even cut (with ``speeds``: by count)."""
    costs = times if times is not None else (parameters() if parameters is not None else None)
    if costs is None:
        if speeds is not None:
            costs = [1.0] * n
        else:
            return uniform_counts(n, num_stages)
    if len(costs) != n:
        raise ValueError(f"costs has {len(costs)} entries, expected one per {unit} ({n})")
    if not any(costs):
        costs = [1.0] * n  # nothing counted (no parameters anywhere): every unit alike
    return balanced_counts([float(c) for c in costs], num_stages, placement=placement, speeds=speeds)


def stages_per_rank_note(schedule: str, num_ranks: int, stages_per_rank: int, unit: str = "layer") -> str:
    """For a too-few-layers error: a schedule of several stages per rank needs that many more layers, which a user
    counting ranks does not expect ("3 layers on 4 ranks" under zb-v: 8 stages). "" for one stage per rank."""
    if stages_per_rank <= 1:
        return ""
    stages = num_ranks * stages_per_rank
    return (
        f": schedule {schedule!r} runs {stages_per_rank} stages per rank ({num_ranks} rank{'s' * (num_ranks != 1)} "
        f"x {stages_per_rank} = "
        f"{stages} stages), so it needs at least {stages} {unit}s; or use a schedule of one stage per rank, "
        "such as '1f1b'"
    )


def check_options(
    n: int,
    num_stages: int,
    how: PartitionSpec,
    speeds: Sequence[float] | None = None,
    memory_caps: Sequence[float] | None = None,
    unit: str = "layer",
    why: str = "",
) -> None:
    """Raise for anything :func:`stage_counts` would refuse that needs no profile to see. ``why``: where the stage
    count comes from, appended when there are too few pieces (:func:`stages_per_rank_note`)."""
    if num_stages > n:
        raise ValueError(f"{num_stages} stages need at least {num_stages} {unit}s, got {n}{why}")
    needs_profile(how)  # an unknown mode
    if not isinstance(how, str) or how == "uniform":
        if speeds is not None or memory_caps is not None:
            kind = f"partition={how!r} does not" if isinstance(how, str) else "explicit counts do not"
            raise ValueError(
                f"speeds= and memory_caps= choose cut points; {kind}: "
                "use partition='balanced', 'parameters', 'time' or 'memory'"
            )
        if not isinstance(how, str):
            _checked_counts(how, n, num_stages, unit)
    elif how == "memory" and speeds is not None:
        raise ValueError("partition='memory' balances bytes, which speeds= does not change; use memory_caps=")


def _checked_counts(how: Sequence[int], n: int, num_stages: int, unit: str) -> list[int]:
    counts = [int(c) for c in how]
    if len(counts) != num_stages:
        raise ValueError(f"partition {counts} has {len(counts)} entries, but the schedule has {num_stages} stages")
    empty = [s for s, c in enumerate(counts) if c < 1]
    if empty:
        raise ValueError(f"partition {counts} gives stages {empty} no {unit}s; every stage needs at least one")
    if sum(counts) != n:
        raise ValueError(f"partition {counts} sums to {sum(counts)} {unit}s, but the model has {n}")
    return counts


def counts_to_ranges(counts: Sequence[int]) -> list[range]:
    """Counts per stage as the contiguous index ranges they hold: ``[2, 1]`` -> ``[range(0, 2), range(2, 3)]``."""
    ranges, start = [], 0
    for c in counts:
        ranges.append(range(start, start + c))
        start += c
    return ranges
