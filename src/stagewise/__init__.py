"""stagewise: pipeline-parallel training for PyTorch.

The pure core (actions, schedules, passes, validator, simulator, renderers)
imports no torch; the runtime (``Pipeline``, ``init``, ``Layer``) is loaded on
first use, so ``import stagewise`` stays cheap for planning and drawing.
"""

from __future__ import annotations

from typing import Any

from .actions import Action, Kind, parse_action
from .costs import CostModel
from .parallel import ParallelConfig
from .partition import Partition, partition_costs
from .passes import add_communication, add_grad_sync, lower, split_backward
from .render import render_ascii, render_png, render_trace
from .schedule import Schedule, loop_placement, v_placement
from .schedules import generate, schedule_info, schedule_names
from .simulate import SimResult, simulate
from .timeline import Event, Timeline
from .validate import ScheduleError, validate_schedule

__version__ = "0.1.0"


def build_schedule(
    name: str,
    num_ranks: int,
    num_microbatches: int,
    virtual_stages: int | None = None,
    *,
    grad_sync: bool = True,
) -> Schedule:
    """The complete, validated schedule ``name``: what the runtime executes.

    >>> s = build_schedule("1f1b", num_ranks=2, num_microbatches=2)
    >>> print(s.to_text())
    rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1 0SYNC
    rank 1: 1RECV_F0 1F0 1RECV_F1 1B0 1SEND_B0 1F1 1B1 1SEND_B1 1SYNC
    """
    return lower(generate(name, num_ranks, num_microbatches, virtual_stages), grad_sync=grad_sync)


# Runtime names, imported lazily so the pure core never pulls in torch.distributed.
_LAZY = {
    "Pipeline": ".runtime.pipeline",
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
    "aux_loss": ".runtime.engine.aux",
    "collect_aux_losses": ".runtime.engine.aux",
    "shm_transport": ".runtime.comm.shm",
    "torch_transport": ".runtime.comm.choose",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module = importlib.import_module(_LAZY[name], __name__)
        return getattr(module, name)
    raise AttributeError(f"module 'stagewise' has no attribute {name!r}")


__all__ = [
    "CostModel",
    "Tied",
    "aux_loss",
    "collect_aux_losses",
    "Partition",
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
