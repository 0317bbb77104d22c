"""``Pipeline.from_stages``: bring your own stages, already built, placed and parallelised as you like."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from torch import nn

from .parts import BUILT_MODEL, FROM_MODELS, LAYERS_ONLY, Parts
from .tied import Tied

if TYPE_CHECKING:
    from ..options import Options
    from .parts import PipelineContext

_CUT = "the stages are cut already (each rank passes the modules of its own stages)"


class GivenStages:
    """``modules[s]``: the module (or modules, applied in order) of stage ``s``, for this rank's stages only."""

    entry = "Pipeline.from_stages"
    refused = {
        "partition": _CUT,
        "sample_inputs": _CUT,
        "speeds": _CUT,
        "memory_caps": _CUT,
        "seed": BUILT_MODEL,
        "free_unused": FROM_MODELS,
        "concrete_args": LAYERS_ONLY,
    }

    def __init__(self, modules: Mapping[int, nn.Module | Sequence[nn.Module]]) -> None:
        if not isinstance(modules, Mapping) or not all(isinstance(s, int) for s in modules):
            raise TypeError(
                "Pipeline.from_stages takes a mapping {stage index: module or list of modules} of this rank's "
                f"stages, got {type(modules).__name__}"
            )
        self.modules = {s: [m] if isinstance(m, (nn.Module, Tied)) else list(m) for s, m in modules.items()}
        for s, mods in sorted(self.modules.items()):
            if any(isinstance(m, Tied) for m in mods):
                raise ValueError(
                    f"from_stages: stage {s} holds a sw.Tied: a tie across ranks is invisible to stages built apart "
                    "(each rank holds its own copy); declare ties in a layer list (Pipeline(layers) with sw.Tied), "
                    "or let from_model find them"
                )
            odd = [type(m).__name__ for m in mods if not isinstance(m, nn.Module)]
            if odd or not mods:
                raise TypeError(f"Pipeline.from_stages: stage {s} must be a module or a non-empty list of modules")

    def defaults(self, options: Options) -> Options:
        return options

    def stage_count(self, options: Options) -> int | None:
        return None

    def build(self, ctx: PipelineContext, options: Options) -> Parts:
        mine = set(ctx.local_stages)
        if set(self.modules) != mine:
            raise ValueError(
                f"rank {ctx.rank} holds stages {sorted(mine)} of schedule {ctx.schedule.name!r}, "
                f"but from_stages got stages {sorted(self.modules)}"
            )
        modules = self.modules

        def register(root: nn.Module) -> None:
            for s, mods in sorted(modules.items()):
                root.add_module(f"stage{s}", mods[0] if len(mods) == 1 else nn.ModuleList(mods))

        ranges = [range(s, s + 1) for s in range(ctx.schedule.num_stages)]
        return Parts(modules, register, ranges)
