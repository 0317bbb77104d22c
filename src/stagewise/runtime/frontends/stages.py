"""This rank's stages, built: the modules each local stage applies, and the names they are registered under.

Every frontend ends here: a layer list is planned (:mod:`.balance`) and
built one layer at a time (:func:`build_layer_stages`); ``from_model`` cuts a
model (:mod:`stagewise.runtime.frontends.from_model`); a user may build the
stages themselves (``Pipeline.from_stages``). The Pipeline then wraps them
(hybrid axes), optimises and runs them, without knowing which frontend made
them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ...partition import LayerProfile, PartitionSpec
from .balance import plan_layers
from .layers import LayerLike
from .tied import TiedBuilder

if TYPE_CHECKING:
    from ..context import PipelineContext

log = logging.getLogger(__name__)


@dataclass
class BuiltStages:
    """What a frontend hands the Pipeline.

    ``modules[s]``: the modules local stage ``s`` applies, in order.
    ``register(root)``: puts them on the Pipeline under their one-process names
    (so ``state_dict()`` keys match the one-process model's).
    ``layer_ranges[s]``: which layers (or blocks) of the source stage ``s`` holds.
    ``tied``: the builder of :class:`~stagewise.Tied` modules (None: no ties).
    """

    modules: dict[int, list[nn.Module]]
    register: Callable[[nn.Module], None]
    layer_ranges: list[range]
    profile: LayerProfile | None = None
    model_cut: Any = None
    tied: TiedBuilder | None = None
    tied_copies: dict[str, nn.Module] = field(default_factory=dict)


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
) -> BuiltStages:
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
    return BuiltStages(modules, _registrar(built), plan.ranges, plan.profile, tied=tied, tied_copies=copies)


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


def given_stages(stages: Mapping[int, nn.Module | Sequence[nn.Module]], ctx: PipelineContext) -> BuiltStages:
    """Stages the caller built (``Pipeline.from_stages``): checked against the schedule, registered as ``stage{s}``."""
    mine = set(ctx.local_stages)
    if set(stages) != mine:
        raise ValueError(
            f"rank {ctx.rank} holds stages {sorted(mine)} of schedule {ctx.schedule.name!r}, "
            f"but from_stages got stages {sorted(stages)}"
        )
    modules = {s: [m] if isinstance(m, nn.Module) else list(m) for s, m in stages.items()}

    def register(root: nn.Module) -> None:
        for s, mods in sorted(modules.items()):
            root.add_module(f"stage{s}", mods[0] if len(mods) == 1 else nn.ModuleList(mods))

    ranges = [range(s, s + 1) for s in range(ctx.schedule.num_stages)]
    return BuiltStages(modules, register, ranges)


def stage_device(modules: dict[int, list[nn.Module]], default: torch.device) -> torch.device:
    """The device the stages' parameters live on (``default`` when they have none)."""
    for mods in modules.values():
        for m in mods:
            for p in m.parameters():
                return p.device
    return default
