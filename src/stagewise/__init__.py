"""stagewise: pipeline-parallel training for PyTorch.

The pure core (schedules as data, their passes, validator, simulator, planner, renderers) imports no
torch; the runtime (``Pipeline``, ``init``, ``Layer`` ...) is loaded on first use, so ``import stagewise``
stays cheap for planning and drawing. The names here are the public API; everything else is reachable
from its package (``stagewise.ir``, ``stagewise.passes``, ``stagewise.schedules``, ``stagewise.simulation``,
``stagewise.validate``, ``stagewise.asynchronous``, ``stagewise.partition``, ``stagewise.planning``,
``stagewise.render``, and ``stagewise.runtime`` for the torch side).
"""

from __future__ import annotations

import importlib
import warnings
from typing import TYPE_CHECKING, Any

from ._util import VERSION
from .ir import Action, Schedule, Timeline
from .parallel import ElasticLayout, ParallelConfig
from .passes import build_schedule
from .render import render_ascii, render_png, render_trace
from .schedules import schedule_info, schedule_names
from .simulation import CostModel, SimResult, simulate
from .synthesis import synthesize
from .validate import ScheduleError, validate_schedule

if TYPE_CHECKING:  # loaded on first use (below): the runtime pulls in torch, the planner is not always needed
    from . import checkpoint
    from .partition import LayerProfile
    from .planning import Plan, plan
    from .runtime import (
        HetPipe,
        Layer,
        Mesh,
        MicroBatches,
        Options,
        Pipeline,
        PipelineError,
        Snapshots,
        Tied,
        aux_loss,
        build_model,
        calibrate,
        causal_lm_loss,
        count_tokens,
        init,
        profile,
        stage,
    )

__version__ = VERSION

__all__ = [
    # running a pipeline
    "Pipeline",
    "Options",
    "init",
    "Layer",
    "Tied",
    "build_model",
    "ParallelConfig",
    "ElasticLayout",
    "Snapshots",
    "Mesh",
    "HetPipe",
    "MicroBatches",
    "stage",
    "PipelineError",
    "checkpoint",
    # losses
    "causal_lm_loss",
    "count_tokens",
    "aux_loss",
    # schedules as data
    "Schedule",
    "Action",
    "build_schedule",
    "schedule_names",
    "schedule_info",
    "validate_schedule",
    "ScheduleError",
    # simulating, synthesizing and drawing
    "simulate",
    "synthesize",
    "CostModel",
    "SimResult",
    "Timeline",
    "render_png",
    "render_ascii",
    "render_trace",
    # measuring and planning
    "profile",
    "LayerProfile",
    "calibrate",
    "plan",
    "Plan",
]

#: public names loaded on first use, and where they live
_LAZY = {
    **dict.fromkeys(
        [
            "Pipeline",
            "Options",
            "init",
            "Layer",
            "Tied",
            "build_model",
            "Mesh",
            "HetPipe",
            "MicroBatches",
            "stage",
            "PipelineError",
            "Snapshots",
            "causal_lm_loss",
            "count_tokens",
            "aux_loss",
            "profile",
            "calibrate",
        ],
        "stagewise.runtime",
    ),
    "LayerProfile": "stagewise.partition",
    "plan": "stagewise.planning",
    "Plan": "stagewise.planning",
}

#: names of stagewise 0.1 that moved (deprecated here for one release): name -> the module that has it now
_MOVED = {
    **dict.fromkeys(["Kind", "Event", "parse_action", "loop_placement", "v_placement"], "stagewise.ir"),
    **dict.fromkeys(
        ["add_communication", "add_grad_sync", "add_optimizer_steps", "forward_only", "lower", "split_backward"],
        "stagewise.passes",
    ),
    **dict.fromkeys(["generate", "async_schedule"], "stagewise.schedules"),
    **dict.fromkeys(["AsyncReport", "async_report"], "stagewise.simulation"),
    **dict.fromkeys(["Version", "VersionTable"], "stagewise.asynchronous"),
    "validate_versions": "stagewise.validate",
    **dict.fromkeys(["Partition", "partition_costs"], "stagewise.partition"),
    **dict.fromkeys(["Calibration", "Link"], "stagewise.planning"),
    **dict.fromkeys(
        [
            "BatchNormPolicy",
            "SplitError",
            "SplitModel",
            "split_model",
            "build_mesh",
            "column_parallel",
            "row_parallel",
            "vocab_parallel_embedding",
            "collect_aux_losses",
            "measure_compute_scale",
            "async_reference",
            "wsp_reference",
            "shm_transport",
            "torch_transport",
        ],
        "stagewise.runtime",
    ),
}
#: names of stagewise 0.1 that were renamed: old name -> (module, new name, how to call it now)
_RENAMED = {"pipeline_from_plan": ("stagewise.runtime", "Pipeline", "Pipeline.from_plan(plan, layers, ...)")}


#: subpackages reachable as attributes before anything imported them (``sw.planning.Link``, ``sw.runtime.Mesh``)
_PACKAGES = (
    "asynchronous",
    "checkpoint",
    "ir",
    "partition",
    "passes",
    "planning",
    "render",
    "runtime",
    "schedules",
    "simulation",
    "synthesis",
    "validate",
)


def __getattr__(name: str) -> Any:
    if name in _PACKAGES:  # e.g. sw.checkpoint.save(...) without importing it first
        return importlib.import_module(f".{name}", __name__)
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _MOVED:
        where = _MOVED[name]
        warnings.warn(
            f"stagewise.{name} moved to {where}.{name}; the old name goes away in stagewise 0.3",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(where), name)
    if name in _RENAMED:
        where, new, how = _RENAMED[name]
        warnings.warn(
            f"stagewise.{name} is now {how}; the old name goes away in stagewise 0.3", DeprecationWarning, stacklevel=2
        )
        if name == "pipeline_from_plan":
            pipeline = getattr(importlib.import_module(where), new)
            return lambda plan, layers, **options: pipeline.from_plan(plan, layers, **options)
    raise AttributeError(f"module 'stagewise' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The public names (``__all__``) and the packages, not this module's own imports."""
    return sorted({*__all__, *_PACKAGES, "__version__"})
