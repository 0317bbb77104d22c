"""The layer-list frontend: ``Pipeline(layers, ...)``, each rank building only the layers of its own stages.

The list is planned over the schedule's stages (:mod:`.balance`: ``partition=``, ``speeds=``,
``memory_caps=``), then this rank builds its layers one at a time, layer ``k`` seeded ``seed + k``, so
:func:`~stagewise.build_model` with the same seed is the one-process twin.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from torch import nn

from ...partition import PartitionSpec
from .balance import plan_layers
from .layers import LayerLike, Layers, named_layers
from .parts import FROM_MODELS, LAYERS_ONLY, Parts
from .tied import TiedBuilder

if TYPE_CHECKING:
    from ..options import Options
    from .parts import PipelineContext

log = logging.getLogger(__name__)


class LayerList:
    """``Pipeline(layers, ...)``: a list (or dict, or ``nn.Sequential``) of modules or Layer specs."""

    entry = "Pipeline(layers)"
    refused = {"free_unused": FROM_MODELS, "concrete_args": LAYERS_ONLY}

    def __init__(self, layers: Layers, entry: str | None = None) -> None:
        self.named = named_layers(layers)
        if entry is not None:
            self.entry = entry

    def defaults(self, options: Options) -> Options:
        return options

    def stage_count(self, options: Options) -> int | None:
        return None

    def build(self, ctx: PipelineContext, options: Options) -> Parts:
        parts = build_layer_stages(
            self.named,
            ctx,
            partition=options.partition,
            sample_inputs=options.sample_inputs,
            speeds=options.speeds,
            memory_caps=options.caps,
            seed=options.seed,
            timeout=options.timeout,
            store=options.store,
            has_loss=options.loss_fn is not None,
        )
        if ctx.hybrid is not None and ctx.hybrid.config.tp > 1 and parts.tied is not None:
            parts.tied.check_plan([n for n, _ in self.named], options.tp_plan)
        return parts


def build_layer_stages(
    named: Sequence[tuple[str, LayerLike]],
    ctx: PipelineContext,
    *,
    partition: PartitionSpec = "uniform",
    sample_inputs: Any = None,
    speeds: Sequence[float] | None = None,
    memory_caps: Sequence[float] | None = None,
    seed: int = 0,
    timeout: float = 300.0,
    store: Any = None,
    has_loss: bool = False,
) -> Parts:
    """Plan the layer list over the schedule's stages, then build this rank's layers only (layer k seeded seed+k).

    ``timeout`` and ``store``: the pipeline's, for the profile handed round (see :func:`.balance.on_first_rank`).
    """
    plan = plan_layers(
        named,
        ctx.schedule,
        partition,
        group=ctx.group if ctx.hybrid is None else None,  # every pp group of a mesh must cut alike
        device=ctx.device,
        seed=seed,
        sample_inputs=sample_inputs,
        speeds=speeds,
        memory_caps=memory_caps,
        timeout=timeout,
        store=store,
        has_loss=has_loss,
    )
    tied = TiedBuilder(named, seed, ctx.device)
    modules: dict[int, list[nn.Module]] = {}
    built: list[tuple[str, nn.Module]] = []
    for s in ctx.local_stages:
        modules[s] = []
        for k in plan.ranges[s]:
            name, layer = named[k]
            module = tied.build(layer, k)
            built.append((name, module))
            modules[s].append(module)
    held = {name for name, _ in built}
    copies = {  # the module's one-process name (its first use's) -> tied module held here for a later use only
        _first_use_name(named, k0, name0): tied.built[key]
        for key, (k0, name0, _) in tied.first.items()
        if key in tied.built and name0 not in held
    }
    log.info(
        "stagewise: rank %d holds stages %s (layers %s) of schedule %r",
        ctx.rank,
        list(ctx.local_stages),
        [f"{r.start}..{r.stop - 1}" for r in (plan.ranges[s] for s in ctx.local_stages)],
        ctx.schedule.name,
    )
    return Parts(modules, _registrar(built), plan.ranges, plan.profile, tied=tied, tied_copies=copies, seeded=True)


def _first_use_name(named: Sequence[tuple[str, LayerLike]], k0: int, name0: str) -> str:
    """Where the one-process model holds a tied module: at its first use, under ``.module`` when that use
    wraps it with a ``forward_fn`` (a :class:`~stagewise.runtime.frontends.tied.TiedCall`)."""
    return f"{name0}.module" if getattr(named[k0][1], "forward_fn", None) is not None else name0


def _registrar(built: list[tuple[str, nn.Module]]) -> Callable[[nn.Module], None]:
    def register(root: nn.Module) -> None:
        for name, module in built:
            if hasattr(root, name) and name not in root._modules:
                raise ValueError(f"layer name {name!r} clashes with a Pipeline attribute; rename the layer")
            root.add_module(name, module)

    return register
