"""Where a pipeline runs: its process group (or mesh), this rank, the validated schedule, the device.

Resolved once, before anything is built, so that every frontend (layer
lists, ``from_model``, already-built stages) checks the same things the same
way and refuses bad input before any rank communicates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..ir import Schedule
from ..passes import add_optimizer_steps, lower
from ..schedules import schedule_info
from ..validate import validate_schedule, validate_versions
from .comm import groups
from .comm.faults import exit_hook

if TYPE_CHECKING:
    from ..parallel import ParallelConfig
    from .hybrid.hybrid import Hybrid
    from .hybrid.mesh import Mesh


@dataclass
class PipelineContext:
    """The group the schedule runs on, this rank in it, the schedule, the device, and the hybrid axes (or None)."""

    group: Any
    rank: int
    num_ranks: int
    schedule: Schedule
    device: torch.device
    hybrid: Hybrid | None

    @property
    def local_stages(self) -> tuple[int, ...]:
        return tuple(self.schedule.stages_of(self.rank))


def resolve_context(
    *,
    schedule: str | Schedule,
    microbatches: int | None,
    virtual_stages: int | None,
    group: Any = None,
    parallel: ParallelConfig | Mesh | None = None,
    device: torch.device | str | None = None,
    optimizer_steps: str | None = None,
) -> PipelineContext:
    """The context of a new pipeline; the schedule is complete and validated for the group's size.

    ``optimizer_steps``: the pipeline steps an optimizer per stage, so the schedule gets a STEP per stage
    (:func:`stagewise.passes.lowering.add_optimizer_steps`): ``"after_sync"`` right after each stage's SYNC,
    ``"at_end"`` at the end of each rank's list (see :attr:`RunOptions.step_placement`); None: no STEP.
    """
    groups.require_initialized()
    exit_hook.install()  # programs that set up torch.distributed themselves leave cleanly too (as after sw.init)
    if parallel is not None:
        _refuse_async_hybrid(schedule, parallel)
    hybrid = _hybrid(parallel, group)  # pp x dp x sharding x tp: the schedule runs on the pp group
    pg = groups.group_or_world(group if hybrid is None else hybrid.pp_group)
    rank, size = groups.group_rank(pg), groups.group_size(pg)
    sched = resolve_schedule(schedule, size, microbatches, virtual_stages, optimizer_steps=optimizer_steps)
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if groups.backend_of(pg) == "nccl" else "cpu"
    return PipelineContext(pg, rank, size, sched, torch.device(device), hybrid)


def resolve_schedule(
    schedule: str | Schedule,
    num_ranks: int,
    microbatches: int | None,
    virtual_stages: int | None,
    *,
    optimizer_steps: str | None = None,
) -> Schedule:
    """The complete, validated schedule to run, checked against the group before anything is built.

    With ``optimizer_steps`` (``"after_sync"`` or ``"at_end"``) every stage has a STEP (a schedule that places
    its own keeps them).
    """
    if optimizer_steps not in (None, "after_sync", "at_end"):
        raise ValueError(f"optimizer_steps must be None, 'after_sync' or 'at_end', got {optimizer_steps!r}")
    at_end = optimizer_steps == "at_end"
    from .. import build_schedule

    if isinstance(schedule, str):
        schedule_info(schedule)  # a clear error for unknown names
        m = num_ranks if microbatches is None else microbatches
        built = build_schedule(schedule, num_ranks, m, virtual_stages, optimizer_steps=optimizer_steps == "after_sync")
        built = _steps_at_end(built) if at_end else built
        validate_versions(built)  # asynchronous schedules: the version rules too (a no-op for the others)
        return built
    if not isinstance(schedule, Schedule):
        raise TypeError(f"schedule must be a registered name or a stagewise.Schedule, got {type(schedule).__name__}")
    if schedule.num_ranks != num_ranks:
        raise ValueError(
            f"schedule {schedule.name!r} has {schedule.num_ranks} ranks, but the process group has {num_ranks}"
        )
    if microbatches is not None and microbatches != schedule.num_microbatches:
        raise ValueError(
            f"microbatches={microbatches}, but schedule {schedule.name!r} runs {schedule.num_microbatches}"
        )
    if virtual_stages is not None and virtual_stages != schedule.virtual_stages:
        raise ValueError(
            f"virtual_stages={virtual_stages}, but schedule {schedule.name!r} has {schedule.virtual_stages} per rank"
        )
    if schedule.is_complete:
        if optimizer_steps is not None:
            schedule = add_optimizer_steps(schedule, at_end=at_end)
        validate_schedule(schedule)
    else:
        schedule = lower(schedule, optimizer_steps=optimizer_steps == "after_sync")
        if at_end:
            schedule = _steps_at_end(schedule)
    validate_versions(schedule)  # asynchronous schedules: the version rules too (a no-op for the others)
    return schedule


def _steps_at_end(schedule: Schedule) -> Schedule:
    stepped = add_optimizer_steps(schedule, at_end=True)
    validate_schedule(stepped)
    return stepped


def _refuse_async_hybrid(schedule: str | Schedule, parallel: Any) -> None:
    """parallel= with an asynchronous schedule: data parallelism only, checked before the mesh is built."""
    from .asynchronous.train import is_async_request

    config = getattr(parallel, "config", parallel)  # a Mesh carries its ParallelConfig
    if is_async_request(schedule) and (getattr(config, "tp", 1) > 1 or getattr(config, "sharding", 1) > 1):
        name = schedule if isinstance(schedule, str) else schedule.name
        raise ValueError(
            f"asynchronous schedule {name!r} supports parallel= with pp and dp only, got tp={config.tp}, "
            f"sharding={config.sharding}: weight snapshots of split or sharded parameters are not implemented"
        )


def _hybrid(parallel: ParallelConfig | Mesh | None, group: Any) -> Hybrid | None:
    """The hybrid-parallel parts for ``parallel=`` (a ParallelConfig or Mesh), or None."""
    if parallel is None:
        return None
    if group is not None:
        raise ValueError("pass either group= or parallel=: with parallel= the pipeline runs on the mesh's pp group")
    from .hybrid.hybrid import Hybrid

    return Hybrid(parallel)
