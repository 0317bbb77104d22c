"""Run a plan: map a :class:`~stagewise.Plan` to the ``Pipeline`` keywords that execute it."""

from __future__ import annotations

from typing import Any

from ...planning import Plan
from ..hybrid.mesh import Mesh
from ..pipeline import Pipeline


def pipeline_from_plan(plan: Plan, layers: Any, **pipeline_options: Any) -> Pipeline:
    """``sw.Pipeline(layers, schedule=..., microbatches=..., virtual_stages=..., partition=counts, recompute=...,
    parallel=ParallelConfig(...), **pipeline_options)`` for ``plan``.

    The plan fixes the layout and the schedule; everything else (``loss_fn``,
    ``tp_plan``, ``optimizer``, ``seed``, ...) comes from ``pipeline_options``.
    Passing one of the plan's own keywords there is an error, so a run cannot
    silently differ from what was predicted - except ``parallel=`` a built
    :class:`~stagewise.Mesh` of the plan's own layout, so that several
    pipelines of one layout share one set of process groups (each gloo group
    keeps a polling thread alive for the rest of the run).
    """
    if not isinstance(plan, Plan):
        raise TypeError(f"pipeline_from_plan: expected a stagewise Plan, got {type(plan).__name__}")
    options = plan.pipeline_options()
    mesh = pipeline_options.get("parallel")
    if isinstance(mesh, Mesh):
        if mesh.config != plan.layout:
            raise ValueError(
                f"pipeline_from_plan: parallel= is a mesh of {mesh.config.describe()}, "
                f"the plan ({plan.describe()}) needs {plan.layout.describe()}"
            )
        options["parallel"] = pipeline_options.pop("parallel")
    clash = sorted(set(options) & set(pipeline_options))
    if clash:
        raise ValueError(
            f"pipeline_from_plan: {clash} are set by the plan ({plan.describe()}); leave them out of the options"
        )
    n_layers = len(layers) if hasattr(layers, "__len__") else None
    if n_layers is not None and n_layers != sum(plan.partition):
        raise ValueError(
            f"pipeline_from_plan: the plan cuts {sum(plan.partition)} layers {list(plan.partition)}, "
            f"but {n_layers} layers were given"
        )
    if plan.layout.tp > 1 and pipeline_options.get("tp_plan") is None:
        raise ValueError(f"pipeline_from_plan: the plan uses tp={plan.layout.tp}; pass tp_plan= for its layers")
    return Pipeline(layers, **options, **pipeline_options)
