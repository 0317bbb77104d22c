"""Where a pipeline runs: its process group (or mesh), this rank, the validated schedule, the device
(a :class:`~stagewise.runtime.frontends.parts.PipelineContext`, what every frontend builds for).

Resolved once, before anything is built, so that every frontend (layer
lists, ``from_model``, already-built stages) checks the same things the same
way and refuses bad input before any rank communicates.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ...ir import Schedule
from ...passes import add_optimizer_steps, build_schedule, lower
from ...schedules import schedule_info
from ...validate import validate_schedule, validate_versions
from ..comm import groups
from ..comm.faults import exit_hook
from ..frontends.parts import PipelineContext

if TYPE_CHECKING:
    from ...parallel import ParallelConfig
    from ..hybrid.hybrid import Hybrid
    from ..hybrid.mesh import Mesh
    from ..options import Options


def resolve_schedule_for(options: Options, stages: int | None = None) -> Schedule:
    """The complete, validated schedule of a new pipeline, for its group's size; no process group is made.

    ``stages``: how many stages the model is cut into, when its source fixes it (a tagged model); else
    ``options.stages``, else the schedule's own count. The schedule gets a STEP per stage when the pipeline
    steps an optimizer (:attr:`Options.optimizer_steps`, placed as :attr:`Options.steps_at_end` says).
    """
    groups.require_initialized()
    size = pipeline_size(options)
    if stages is not None and options.stages is not None and options.stages != stages:
        raise ValueError(f"stages={options.stages}, but the model's tags name {stages} stages (0 to {stages - 1})")
    count = stages if stages is not None else options.stages
    return schedule_for_stages(options, size, count, "the model's tags" if stages is not None else "")


def place(options: Options, schedule: Schedule) -> PipelineContext:
    """Where ``schedule`` runs: the process group (the mesh's pp group with ``parallel=``), this rank, the device.

    With ``parallel=`` a :class:`~stagewise.ParallelConfig`, the mesh's process groups are made here.
    """
    exit_hook.install()  # programs that set up torch.distributed themselves leave cleanly too (as after sw.init)
    hybrid = _hybrid(options.parallel)  # pp x dp x sharding x tp: the schedule runs on the pp group
    pg = groups.group_or_world(options.group if hybrid is None else hybrid.pp_group)
    rank, size = groups.group_rank(pg), groups.group_size(pg)
    if size != schedule.num_ranks:
        raise ValueError(f"schedule {schedule.name!r} has {schedule.num_ranks} ranks, but the group has {size}")
    device = options.device
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if groups.backend_of(pg) == "nccl" else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={str(device)!r} on rank {rank}, but this process sees no CUDA device")
    return PipelineContext(pg, rank, size, schedule, device, hybrid)


def pipeline_size(options: Options) -> int:
    """How many ranks the schedule runs on: the mesh's ``pp`` degree, or the group's size."""
    parallel = options.parallel
    if parallel is not None:
        config = getattr(parallel, "config", parallel)  # a Mesh carries its ParallelConfig
        pp = getattr(config, "pp", None)
        if not isinstance(pp, int):
            raise TypeError(f"parallel= takes a stagewise.ParallelConfig or Mesh, got {type(parallel).__name__}")
        return pp
    return int(groups.group_size(groups.group_or_world(options.group)))


def schedule_for_stages(options: Options, num_ranks: int, stages: int | None, source: str = "") -> Schedule:
    """The schedule to run on ``num_ranks`` ranks, with ``stages`` stages when the model fixes the count.

    With a schedule name and no ``virtual_stages``, ``stages`` divided by the group size gives the virtual
    stages per rank (4 stages on 2 ranks with ``"zb-v"``).
    """
    schedule, m, v = options.schedule, options.microbatches, options.virtual_stages
    steps, at_end = options.optimizer_steps, options.steps_at_end
    what = f"{source} name {stages} stages" if source else f"stages={stages}"
    if isinstance(schedule, str) and stages is not None and v is None:
        if stages % num_ranks:
            raise ValueError(f"{what}, which do not divide evenly over {num_ranks} ranks")
        try:
            return resolve_schedule(
                schedule, num_ranks, m, stages // num_ranks, optimizer_steps=steps, steps_at_end=at_end
            )
        except ValueError as err:
            raise ValueError(
                f"{what} on {num_ranks} ranks ({stages // num_ranks} per rank), which schedule {schedule!r} "
                f"cannot run: {err}"
            ) from err
    sched = resolve_schedule(schedule, num_ranks, m, v, optimizer_steps=steps, steps_at_end=at_end)
    if stages is not None and sched.num_stages != stages:
        raise ValueError(f"{what}, but schedule {sched.name!r} on {num_ranks} ranks runs {sched.num_stages} stages")
    return sched


def resolve_schedule(
    schedule: str | Schedule,
    num_ranks: int,
    microbatches: int | None,
    virtual_stages: int | None,
    *,
    optimizer_steps: bool = False,
    steps_at_end: bool = False,
) -> Schedule:
    """The complete, validated schedule to run, checked against the group before anything is built.

    With ``optimizer_steps`` every stage has a STEP (a schedule that places its own keeps them): right after
    its SYNC, or with ``steps_at_end`` at the end of each rank's list.
    """
    after_sync, at_end = optimizer_steps and not steps_at_end, optimizer_steps and steps_at_end
    if isinstance(schedule, str):
        schedule_info(schedule)  # a clear error for unknown names
        m = num_ranks if microbatches is None else microbatches
        built = build_schedule(schedule, num_ranks, m, virtual_stages, optimizer_steps=after_sync)
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
        table: Any = schedule.meta.get("versions")  # an asynchronous window's: its mini-batches of m micro-batches
        per = f" in a window of {table.minibatches} mini-batches of {table.microbatches}" if table is not None else ""
        raise ValueError(
            f"microbatches={microbatches}, but schedule {schedule.name!r} runs {schedule.num_microbatches}{per}: a "
            "Schedule fixes its micro-batches; drop microbatches= (or give the same number)"
        )
    if virtual_stages is not None and virtual_stages != schedule.virtual_stages:
        raise ValueError(
            f"virtual_stages={virtual_stages}, but schedule {schedule.name!r} has {schedule.virtual_stages} per rank"
        )
    if schedule.is_complete:
        if optimizer_steps:
            schedule = add_optimizer_steps(schedule, at_end=at_end)
        validate_schedule(schedule)
    else:
        schedule = lower(schedule, optimizer_steps=after_sync)
        if at_end:
            schedule = _steps_at_end(schedule)
    validate_versions(schedule)  # asynchronous schedules: the version rules too (a no-op for the others)
    return schedule


def _steps_at_end(schedule: Schedule) -> Schedule:
    stepped = add_optimizer_steps(schedule, at_end=True)
    validate_schedule(stepped)
    return stepped


def _hybrid(parallel: ParallelConfig | Mesh | None) -> Hybrid | None:
    """The hybrid-parallel parts for ``parallel=`` (a ParallelConfig or Mesh), or None."""
    if parallel is None:
        return None
    from ..hybrid.hybrid import Hybrid

    return Hybrid(parallel)
