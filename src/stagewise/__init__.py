"""stagewise: pipeline-parallel training for PyTorch.

The pure core (schedules as data, their passes, validator, simulator, planner, renderers) imports no
torch; the runtime (``Pipeline``, ``init``, ``Layer`` ...) is loaded on first use, so ``import stagewise``
stays cheap for planning and drawing. The names here are the public API; everything else is reachable
from its package (``stagewise.ir``, ``stagewise.passes``, ``stagewise.schedules``, ``stagewise.simulation``,
``stagewise.validate``, ``stagewise.asynchronous``, ``stagewise.partition``, ``stagewise.planning``,
``stagewise.render``, ``stagewise.interop`` for torch.distributed.pipelining's schedules, and
``stagewise.runtime`` for the torch side).
"""

from __future__ import annotations

import importlib
import sys
import warnings
from typing import TYPE_CHECKING, Any

from ._util import VERSION
from .interop import from_torch, to_torch_csv
from .ir import Action, Schedule, Timeline
from .parallel import ElasticLayout, ParallelConfig
from .partition import LayerProfile
from .passes import build_schedule
from .render import render_ascii, render_png, render_trace
from .schedules import schedule_info, schedule_names
from .simulation import CostModel, SimResult, simulate
from .synthesis import synthesize
from .validate import ScheduleError, validate_schedule

if TYPE_CHECKING:  # loaded on first use (__getattr__): the runtime pulls in torch, the planner is not always needed
    from typing_extensions import Unpack

    from . import checkpoint
    from .planning import Plan, PlanOptions
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

#: the public API: the one list of its names. A name not imported above is loaded on first use: the runtime's,
#: a subpackage (``checkpoint``), or a name :data:`_ELSEWHERE` says (tests/core/test_public_names.py checks
#: that the imports above and the TYPE_CHECKING block agree with it)
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
    # torch.distributed.pipelining and torchtitan: their schedules read, ours written for their runtime
    "from_torch",
    "to_torch_csv",
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
#: public names loaded on first use from elsewhere than the runtime: the planner's result
_ELSEWHERE = {"Plan": "stagewise.planning"}


def plan(profile: LayerProfile, processes: int, **options: Unpack[PlanOptions]) -> list[Plan]:
    """The ``top`` fastest plans that fit memory (:func:`stagewise.planning.plan`), the same on every rank.

    Inside a job (torch.distributed initialised, more than one process) this is a collective: every rank
    calls it, global rank 0's inputs go to every rank and every rank gets the same plans
    (:func:`stagewise.runtime.frontends.plan_agreement.search_together`), so that ``Pipeline.from_plan``
    builds one pipeline, not several that wait on each other. Anywhere else it is the pure planner itself,
    and loads no torch. The options and what they mean: :func:`stagewise.planning.plan`.
    """
    cal = options.get("calibration")
    if options.get("intra") is None and (cal is None or not cal.links_measured):
        warnings.warn(
            "stagewise.plan: the links are not calibrated (no intra=, no calibration= with measured links): every "
            "transfer and collective is free in these plans, which favours data parallelism and sharding; pass "
            "calibration=sw.calibrate(...) or intra=(latency seconds, bandwidth bytes/s)",
            stacklevel=2,
        )
    if _in_a_job():
        from .runtime.frontends.plan_agreement import search_together

        return list(search_together(profile, processes, **options).plans)
    from .planning import plan as pure

    return pure(profile, processes, **options)


def _in_a_job() -> bool:
    """Whether this process is one rank of an initialised torch.distributed job of several (torch is not
    imported to find out: a process that never loaded torch.distributed is in no job)."""
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


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
            "shm_transport",
            "torch_transport",
        ],
        "stagewise.runtime",
    ),
}
#: names of stagewise 0.1 that were renamed: old name -> (module, new name, how to call it now)
_RENAMED = {"pipeline_from_plan": ("stagewise.runtime", "Pipeline", "Pipeline.from_plan(plan, layers, ...)")}
#: names of stagewise 0.1 that are gone: name -> what it was and where it is
_GONE = {
    name: f"a test-only replay of a rule; the repository keeps it in tests/oracles/{name}.py"
    for name in ("async_reference", "wsp_reference")
}


#: subpackages reachable as attributes before anything imported them (``sw.planning.Link``, ``sw.runtime.Mesh``)
_PACKAGES = (
    "asynchronous",
    "checkpoint",
    "interop",
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
    if name in __all__:  # not imported above: the runtime's, unless _ELSEWHERE says
        return getattr(importlib.import_module(_ELSEWHERE.get(name, "stagewise.runtime")), name)
    if name in _MOVED:
        where = _MOVED[name]
        warnings.warn(
            f"stagewise.{name} moved to {where}.{name}; the old name goes away in stagewise 0.3",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(where), name)
    if name in _GONE:
        raise AttributeError(f"stagewise.{name} is gone: it was {_GONE[name]}")
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
