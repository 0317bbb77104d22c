"""stagewise: pipeline-parallel training for PyTorch.

The pure core (actions, schedules, passes, validator, simulator, renderers)
imports no torch; the runtime (``Pipeline``, ``init``, ``Layer``) is loaded on
first use, so ``import stagewise`` stays cheap for planning and drawing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._gc import gc_paused
from .actions import Action, Kind, parse_action
from .costs import CostModel
from .parallel import ParallelConfig
from .partition import Partition, partition_costs
from .passes import add_communication, add_grad_sync, add_optimizer_steps, forward_only, lower, split_backward
from .render import render_ascii, render_png, render_trace
from .schedule import Schedule, loop_placement, v_placement
from .schedules import generate, schedule_info, schedule_names
from .schedules.asynchronous import async_schedule
from .simulate import SimResult, simulate
from .simulate_async import AsyncReport, async_report
from .timeline import Event, Timeline
from .validate import ScheduleError, validate_schedule
from .validate_versions import validate_versions
from .versions import Version, VersionTable

if TYPE_CHECKING:  # loaded on first use (below): `stagewise simulate` does not need the planner
    from .planning import Calibration, Link, Plan, plan

__version__ = "0.1.0"


def build_schedule(
    name: str,
    num_ranks: int,
    num_microbatches: int,
    virtual_stages: int | None = None,
    *,
    grad_sync: bool = True,
    optimizer_steps: bool = False,
) -> Schedule:
    """The complete, validated schedule ``name``: what the runtime executes.

    >>> s = build_schedule("1f1b", num_ranks=2, num_microbatches=2)
    >>> print(s.to_text())
    rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1 0SYNC
    rank 1: 1RECV_F0 1F0 1RECV_F1 1B0 1SEND_B0 1F1 1B1 1SEND_B1 1SYNC
    """
    with gc_paused():  # one collection after the build instead of one after each of its three steps
        schedule = generate(name, num_ranks, num_microbatches, virtual_stages)
        return lower(schedule, grad_sync=grad_sync, optimizer_steps=optimizer_steps)


# Runtime names, imported lazily so the pure core never pulls in torch.distributed.
_LAZY = {
    "Calibration": ".planning",
    "Link": ".planning",
    "Plan": ".planning",
    "plan": ".planning",
    "Pipeline": ".runtime.pipeline",
    "BatchNormPolicy": ".runtime.engine.batchnorm",
    "PipelineError": ".runtime.errors",
    "init": ".runtime.comm.setup",
    "Layer": ".runtime.model.layers",
    "MicroBatches": ".runtime.engine.microbatch",
    "build_model": ".runtime.model.layers",
    "LayerProfile": ".profile_data",
    "SplitError": ".runtime.frontends.split",
    "SplitModel": ".runtime.frontends.split",
    "profile": ".runtime.model.profiling",
    "split_model": ".runtime.frontends.split",
    "stage": ".runtime.frontends.split",
    "Mesh": ".runtime.hybrid.mesh",
    "build_mesh": ".runtime.hybrid.mesh",
    "column_parallel": ".runtime.hybrid.tensor_parallel",
    "row_parallel": ".runtime.hybrid.tensor_parallel",
    "vocab_parallel_embedding": ".runtime.hybrid.tensor_parallel",
    "Tied": ".runtime.model.tied",
    "causal_lm_loss": ".runtime.losses",
    "count_tokens": ".runtime.losses",
    "aux_loss": ".runtime.engine.aux",
    "collect_aux_losses": ".runtime.engine.aux",
    "pipeline_from_plan": ".runtime.from_plan",
    "calibrate": ".runtime.calibrate",
    "measure_compute_scale": ".runtime.compute_scale",
    "async_reference": ".runtime.asynchronous.reference",
    "HetPipe": ".runtime.asynchronous.hetpipe",
    "wsp_reference": ".runtime.asynchronous.wsp_reference",
    "shm_transport": ".runtime.comm.shm",
    "torch_transport": ".runtime.comm.choose",
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
