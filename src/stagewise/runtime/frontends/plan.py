"""``Pipeline.from_plan``: a :class:`~stagewise.Plan` from :func:`stagewise.plan`, run on a layer list or on a
transformers causal LM (profiled per decoder layer by ``sw.profile``: the plan's partition cuts decoder layers,
and the model is built as :class:`~.hf.FromHF` builds it, its loss by default transformers').

The plan fixes the layout and the schedule (``schedule``, ``microbatches``, ``virtual_stages``,
``partition``, ``recompute``, ``parallel``); everything else comes from the caller's options. Giving one
of the plan's own options is an error, so a run cannot silently differ from what was predicted - except
``parallel=`` a built :class:`~stagewise.Mesh` of the plan's own layout, so that several pipelines of one
layout share one set of process groups (each gloo group keeps a polling thread alive for the run).

Every rank must run the same plan: before the plan's options are applied - before its layout's process
groups exist - the ranks compare the plans' digests (:func:`.plan_agreement.check_same_plan`,
a collective bounded by the pipeline's ``timeout``) and every rank refuses a mismatch with the same error,
naming which ranks hold which plan. (It cannot wait for the placed context: ranks holding plans of different
layouts would already be making different process groups there.)
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, cast

from torch import nn

from ...planning import Plan
from ...schedules import is_asynchronous
from .hf import FromHF
from .hf.profile import is_hf_model
from .layer_list import LayerList
from .layers import Layers
from .parts import Parts
from .plan_agreement import check_same_plan

if TYPE_CHECKING:
    from ..options import Options
    from .parts import PipelineContext


class FromPlan:
    """The plan's options on top of the caller's, then the layer list cut by the plan's partition."""

    entry = "Pipeline.from_plan"

    def __init__(self, plan: Plan, layers: Layers | nn.Module, *, check: bool = True) -> None:
        """``check``: a transformers model's equivalence check (:class:`~.hf.FromHF`'s)."""
        if not isinstance(plan, Plan):
            raise TypeError(f"Pipeline.from_plan: expected a stagewise Plan, got {type(plan).__name__}")
        if is_asynchronous(plan.schedule):
            raise ValueError(
                f"Pipeline.from_plan: plans run synchronous schedules (the planner searches those only), "
                f"got {plan.schedule!r}: build Pipeline(layers, schedule={plan.schedule!r}, ...) instead"
            )
        self.plan = plan
        self.layers: FromHF | LayerList
        self.refused: dict[str, str] = {}
        if is_hf_model(layers):  # a transformers model: decoder layers, profiled by sw.profile as from_hf cuts
            hf = FromHF(cast(nn.Module, layers), check=check)
            self.layers, self.refused, n, what = hf, dict(hf.refused), hf.num_layers, "decoder layers"
        else:
            listed = LayerList(cast(Layers, layers), entry=self.entry)
            self.layers, n, what = listed, len(listed.named), "layers"
        if n != sum(plan.partition):
            raise ValueError(
                f"Pipeline.from_plan: the plan cuts {sum(plan.partition)} layers {list(plan.partition)}, "
                f"but {n} {what} were given (profile the model you run: sw.profile(model, sample))"
            )

    def defaults(self, options: Options) -> Options:
        plan = self.plan
        check_same_plan(plan, self.entry, options.timeout, options.store, options.group)
        own: dict[str, Any] = plan.pipeline_options()
        mesh = options.parallel if options.is_given("parallel") else None
        if mesh is not None and not _is_plan_mesh(mesh, plan):
            raise ValueError(
                f"Pipeline.from_plan: parallel= must be left out or be a built Mesh of the plan's layout "
                f"({plan.layout.describe()}), got {mesh!r}"
            )
        clash = sorted(k for k in own if options.is_given(k) and k != "parallel")
        if clash:
            raise ValueError(
                f"Pipeline.from_plan: {', '.join(k + '=' for k in clash)} are set by the plan ({plan.describe()}); "
                "leave them out of the options"
            )
        if mesh is not None:
            own["parallel"] = mesh
        options = replace(options, **own)
        if isinstance(self.layers, FromHF):  # transformers' loss, the config's tensor-parallel plan
            options = self.layers.defaults(options)
        if plan.layout.tp > 1 and options.tp_plan is None:
            raise ValueError(f"Pipeline.from_plan: the plan uses tp={plan.layout.tp}; pass tp_plan= for its layers")
        return options

    def stage_count(self, options: Options) -> int | None:
        return None

    def build(self, ctx: PipelineContext, options: Options) -> Parts:
        return self.layers.build(ctx, options)


def _is_plan_mesh(mesh: Any, plan: Plan) -> bool:
    from ..hybrid.mesh import Mesh

    if not isinstance(mesh, Mesh):
        return False
    if mesh.config != plan.layout:
        raise ValueError(
            f"Pipeline.from_plan: parallel= is a mesh of {mesh.config.describe()}, "
            f"the plan ({plan.describe()}) needs {plan.layout.describe()}"
        )
    return True
