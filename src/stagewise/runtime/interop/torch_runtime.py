"""A stagewise schedule loaded into torch's ``_PipelineScheduleRuntime``: :func:`torch_runtime`.

What torchtitan does with a schedule CSV file (written by :func:`stagewise.interop.to_torch_csv`), in one
call: the file is written, torch's loader reads it (and, for ``compute_only``, lowers it with its own
passes), and the returned schedule object trains with torch's ``step()``.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ...interop import TorchFormat, to_torch_csv
from ...ir import Schedule


def torch_runtime(
    schedule: Schedule,
    stages: Sequence[Any],
    *,
    loss_fn: Callable[..., Any] | None,
    format: TorchFormat = "compute_only",
    **kwargs: Any,
) -> Any:
    """torch's ``_PipelineScheduleRuntime`` for this rank's ``stages``, running ``schedule``.

    ``stages``: the ``torch.distributed.pipelining.PipelineStage`` objects this rank holds, the ones
    ``schedule.stages_of(rank)`` names, each built with ``num_stages = schedule.num_stages``. ``kwargs``
    go to torch's constructor (``scale_grads``, ``output_merge_spec`` ...). Raises ``ValueError`` for
    stages that do not match the schedule, and for a schedule torch cannot run
    (:func:`stagewise.interop.torch_problems`).
    """
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    stages = list(stages)
    if not stages:
        raise ValueError("torch_runtime needs this rank's PipelineStage objects, got none")
    _check_stages(schedule, stages)
    text = to_torch_csv(schedule, format=format)
    runtime = _PipelineScheduleRuntime(stages, schedule.num_microbatches, loss_fn=loss_fn, **kwargs)
    with tempfile.TemporaryDirectory(prefix="stagewise-torch-") as folder:
        path = Path(folder) / f"{schedule.name}.csv"
        path.write_text(text)
        runtime._load_csv(str(path), format=format)
    return runtime


def _check_stages(schedule: Schedule, stages: list[Any]) -> None:
    rank = stages[0].group_rank
    if stages[0].group_size != schedule.num_ranks:
        raise ValueError(
            f"schedule {schedule.name!r} runs on {schedule.num_ranks} ranks, the stages' group has "
            f"{stages[0].group_size}"
        )
    counts = {s.num_stages for s in stages}
    if counts != {schedule.num_stages}:
        raise ValueError(
            f"schedule {schedule.name!r} has {schedule.num_stages} stages; the stages were built with "
            f"num_stages={sorted(counts)}"
        )
    held = sorted(s.stage_index for s in stages)
    wanted = sorted(schedule.stages_of(rank))
    if held != wanted:
        raise ValueError(f"schedule {schedule.name!r} places stages {wanted} on rank {rank}, got stages {held}")
