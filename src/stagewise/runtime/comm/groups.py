"""Process groups: who is in a group, its backend and store, and the side groups a pipeline needs."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

#: backends whose point-to-point must be posted in schedule batches (tests may add "gloo")
GROUPED_BACKENDS = {"nccl"}

_pipelines_made: dict[str, int] = {}


def forget() -> None:
    """The process group is given up (an in-place elastic job's next generation): names and groups made for it
    go, so that every member of the next one counts alike."""
    _pipelines_made.clear()
    _prepared.clear()


def require_initialized() -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialised: call stagewise.init() (or torch.distributed.init_process_group) "
            "before building a Pipeline"
        )


def initialized() -> bool:
    """Whether torch.distributed has a default process group in this process."""
    return bool(dist.is_available() and dist.is_initialized())


def registered() -> dict[int, Any]:
    """Every process group this process is in and has not destroyed, by id (torch's registry: it has no public
    listing; a group stays in it, with its gloo threads, until ``destroy_process_group``)."""
    return {id(g): g for g in dist.distributed_c10d._world.pg_map}


def made_since(before: dict[int, Any]) -> list[Any]:
    """The groups registered now that were not in ``before`` (:func:`registered`)."""
    return [g for i, g in registered().items() if i not in before]


def destroy(made: Sequence[Any]) -> None:
    """Destroy the groups of ``made`` still registered (each process its own: no collective), never the default;
    then DTensor's caches forgotten (:func:`forget_meshes`)."""
    live = registered()
    gone = False
    for group in made:
        if id(group) in live and group is not dist.GroupMember.WORLD:
            dist.destroy_process_group(group)
            gone = True
    if gone:
        forget_meshes()


def forget_meshes() -> None:
    """Empty DTensor's sharding-propagation caches. They key on specs whose ``DeviceMesh`` compares equal by shape
    and names only, and hand back the first mesh seen: a pipeline built after another of the same layout was
    closed (or re-laid out) got its outputs placed on the old mesh, whose destroyed groups then failed every
    collective ("Could not resolve the process group registered under the name 11"). Torch's own debug helper,
    where this torch has it."""
    try:
        from torch.distributed.tensor import debug
    except ImportError:  # (a torch without DTensor: nothing cached)
        return
    clear = getattr(debug, "_clear_sharding_prop_cache", None)
    if clear is not None:
        clear()


def group_or_world(group: Any) -> Any:
    return dist.group.WORLD if group is None else group


def group_rank(group: Any) -> int:
    return dist.get_rank(group)


def group_size(group: Any) -> int:
    return dist.get_world_size(group)


def global_rank() -> int:
    return dist.get_rank()


def global_ranks(group: Any) -> list[int]:
    """The global ranks of ``group`` (None: the world), in group-rank order."""
    return dist.get_process_group_ranks(group_or_world(group))


def backend_of(group: Any) -> str:
    return str(dist.get_backend(group))


def next_pipeline_id(group: Any) -> tuple[str, int]:
    """A name and a tag every rank derives alike, as long as all build their pipelines in the same order."""
    base = getattr(group, "group_name", None) or "group"
    count = _pipelines_made.get(base, 0)
    _pipelines_made[base] = count + 1
    return f"{base}/{count}", count


def new_subgroup(ranks: list[int], member: bool) -> Any:
    """A process group of the global ``ranks``, made by its members only (``member``: this rank is one), or the
    one :func:`prepare_subgroups` made ahead for them (taken by every rank of the pipeline alike)."""
    ready = _prepared.get(tuple(ranks))
    made = ready.pop(0) if ready else None
    if not member:
        return None
    return made if made is not None else dist.new_group(ranks, use_local_synchronization=True)


_prepared: dict[tuple[int, ...], list[Any]] = {}


def prepare_subgroups(sets: Sequence[Sequence[int]]) -> list[Any]:
    """Make the groups of these sets of global ranks now, by every process of the world in one order, for a
    pipeline on fewer processes than the world to take (:func:`new_subgroup`): gloo cannot make a group by its
    members alone once the whole world has made groups together (as a re-layout to fewer processes finds it).
    Groups prepared earlier and not taken are forgotten. Returns the groups made (for the caller to let go)."""
    _prepared.clear()
    made = []
    for ranks in sets:
        made.append(dist.new_group(list(ranks)))
        _prepared.setdefault(tuple(ranks), []).append(made[-1])
    return made


def prepare_gloo(ranks: Sequence[int], timeout: float) -> Any:
    """A gloo group of ``ranks`` made now by every process of the world, for a pipeline on ``ranks`` alone to take
    (:func:`take_gloo`): its snapshot exchange, whose retiring processes build nothing to make it with."""
    made = dist.new_group(list(ranks), backend="gloo", timeout=timedelta(seconds=timeout))
    _prepared_gloo[tuple(ranks)] = made
    return made


def take_gloo(ranks: Sequence[int]) -> Any:
    """The gloo group :func:`prepare_gloo` made for ``ranks`` (once), or None."""
    return _prepared_gloo.pop(tuple(ranks), None)


_prepared_gloo: dict[tuple[int, ...], Any] = {}


def new_world_subgroup(ranks: list[int]) -> Any:
    """A process group of the global ``ranks``, made by every rank of the world (in the same order everywhere)."""
    return dist.new_group(ranks)


def world_size() -> int:
    return int(dist.get_world_size())


def bound(group: Any, timeout: float) -> None:
    """Make ``group``'s backend give up on a collective after ``timeout`` seconds (the pipeline's), not its default.

    For the collectives stagewise does not wait for itself - FSDP2's all-gathers and reduce-scatters, DTensor's
    tensor-parallel reductions, issued and waited for inside torch on the main thread: a gloo wait there can be
    interrupted by nothing but the group's own timeout (30 minutes by default), so a stopped peer would hold
    this rank that long. None, a group this rank is not in, and the default group (the user's) are left alone.
    """
    if group is None or group is dist.GroupMember.NON_GROUP_MEMBER or group is dist.GroupMember.WORLD:
        return
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=timeout), group)


def _delta(timeout: float | None) -> timedelta | None:
    return None if timeout is None else timedelta(seconds=timeout)


def side_group(group: Any, wait: Any = None, timeout: float | None = None) -> Any:
    """A gloo group with the members of ``group``, for eager point-to-point next to a grouped backend.

    ``dist.new_group`` must be called by every process in the same order, and
    each process only knows its own pipeline group, so the groups are gathered
    first: a collective over the default group, as every rank builds its
    Pipeline at the same time (``wait``: the pipeline guard's deadline wait).
    """
    if backend_of(group) not in GROUPED_BACKENDS:
        return None
    from .collectives import gather_json

    mine = tuple(global_ranks(group))
    everyone = [tuple(r) for r in gather_json(list(mine), None, wait, "every rank's pipeline group")]
    found = None
    for ranks in sorted(set(everyone)):
        made = dist.new_group(list(ranks), backend="gloo", timeout=_delta(timeout))
        if ranks == mine:
            found = made
    return found
