"""stagewise: pipeline-parallel training for PyTorch.

The pure core (actions, schedules, passes, validator, simulator, renderers)
imports no torch; the runtime (``Pipeline``, ``init``, ``Layer``) is loaded on
first use, so ``import stagewise`` stays cheap for planning and drawing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .asynchronous import Version, VersionTable
from .ir import Action, Event, Kind, Schedule, Timeline, loop_placement, parse_action, v_placement
from .parallel import ParallelConfig
from .partition import Partition, partition_costs
from .passes import (
    add_communication,
    add_grad_sync,
    add_optimizer_steps,
    build_schedule,
    forward_only,
    lower,
    split_backward,
)
from .render import render_ascii, render_png, render_trace
from .schedules import async_schedule, generate, schedule_info, schedule_names
from .simulate import AsyncReport, CostModel, SimResult, async_report, simulate
from .validate import ScheduleError, validate_schedule, validate_versions

if TYPE_CHECKING:  # loaded on first use (below): `stagewise simulate` does not need the planner
    from .planning import Calibration, Link, Plan, plan

__version__ = "0.1.0"


# Runtime names, imported lazily so the pure core never pulls in torch.distributed.
_LAZY = {
    "Calibration": ".planning",
    "Link": ".planning",
    "Plan": ".planning",
    "plan": ".planning",
    "Pipeline": ".runtime.pipeline",
    "BatchNormPolicy": ".runtime.features.batchnorm",
    "PipelineError": ".runtime.errors",
    "init": ".runtime.comm.setup",
    "Layer": ".runtime.frontends.layers",
    "MicroBatches": ".runtime.engine.microbatch",
    "build_model": ".runtime.frontends.layers",
    "LayerProfile": ".partition.profile_data",
    "SplitError": ".runtime.frontends.split",
    "SplitModel": ".runtime.frontends.split",
    "profile": ".runtime.measure.profiling",
    "split_model": ".runtime.frontends.split",
    "stage": ".runtime.frontends.split",
    "Mesh": ".runtime.hybrid.mesh",
    "build_mesh": ".runtime.hybrid.mesh",
    "column_parallel": ".runtime.hybrid.tensor_parallel",
    "row_parallel": ".runtime.hybrid.tensor_parallel",
    "vocab_parallel_embedding": ".runtime.hybrid.tensor_parallel",
    "Tied": ".runtime.frontends.tied",
    "causal_lm_loss": ".runtime.losses",
    "count_tokens": ".runtime.losses",
    "aux_loss": ".runtime.features.aux",
    "collect_aux_losses": ".runtime.features.aux",
    "pipeline_from_plan": ".runtime.frontends.plan",
    "calibrate": ".runtime.measure.calibrate",
    "measure_compute_scale": ".runtime.measure.compute_scale",
    "async_reference": ".runtime.asynchronous.replay",
    "HetPipe": ".runtime.asynchronous.hetpipe",
    "wsp_reference": ".runtime.asynchronous.wsp_replay",
    "shm_transport": ".runtime.comm.shm.transport",
    "torch_transport": ".runtime.comm.transport.choose",
}


def __getattr__(name: str) -> Any:
    if name == "checkpoint":  # a submodule: sw.checkpoint.save(...) without importing it first
        import importlib

        return importlib.import_module(".checkpoint", __name__)
    if name in _LAZY:
        import importlib

        module = importlib.import_module(_LAZY[name], __name__)
        return getattr(module, name)
    raise AttributeError(f"module 'stagewise' has no attribute {name!r}")


__all__ = [
    "BatchNormPolicy",
    "AsyncReport",
    "CostModel",
    "Version",
    "VersionTable",
    "async_reference",
    "HetPipe",
    "wsp_reference",
    "async_report",
    "async_schedule",
    "validate_versions",
    "Tied",
    "causal_lm_loss",
    "count_tokens",
    "aux_loss",
    "collect_aux_losses",
    "Partition",
    "Calibration",
    "Link",
    "Plan",
    "plan",
    "pipeline_from_plan",
    "calibrate",
    "measure_compute_scale",
    "SimResult",
    "partition_costs",
    "render_ascii",
    "render_png",
    "render_trace",
    "simulate",
    "Action",
    "Event",
    "Kind",
    "Layer",
    "MicroBatches",
    "Pipeline",
    "PipelineError",
    "LayerProfile",
    "Schedule",
    "ScheduleError",
    "SplitError",
    "SplitModel",
    "Timeline",
    "add_communication",
    "add_grad_sync",
    "add_optimizer_steps",
    "forward_only",
    "build_model",
    "build_schedule",
    "generate",
    "init",
    "loop_placement",
    "lower",
    "parse_action",
    "profile",
    "schedule_info",
    "schedule_names",
    "split_backward",
    "split_model",
    "stage",
    "v_placement",
    "Mesh",
    "shm_transport",
    "torch_transport",
    "ParallelConfig",
    "build_mesh",
    "column_parallel",
    "row_parallel",
    "vocab_parallel_embedding",
    "validate_schedule",
]
