"""What every way in is given (:class:`PipelineContext`: where it runs) and hands the assembly (:class:`Parts`:
this rank's built stages), and the frontend protocol.

Construction flows one way: a frontend (a layer list, ``from_model``, ``from_hf``, ``from_stages``, a plan)
says which options it cannot apply and fills in its own defaults, may fix the stage count (a tagged
model), then builds this rank's stages for the resolved context. :func:`stagewise.runtime.assembly.assemble.assemble`
wraps the parts in the engine, whoever made them. No frontend knows the Pipeline class.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import nn

from ...ir import Schedule
from ...partition import LayerProfile
from .tied import TiedBuilder

if TYPE_CHECKING:
    from ..hybrid.hybrid import Hybrid
    from ..options import Options


@dataclass
class PipelineContext:
    """The group the schedule runs on, this rank in it, the schedule, the device, and the hybrid axes (or None)."""

    group: Any
    rank: int
    num_ranks: int
    schedule: Schedule
    device: torch.device
    hybrid: Hybrid | None

    @property
    def local_stages(self) -> tuple[int, ...]:
        return tuple(self.schedule.stages_of(self.rank))

    @property
    def cut_group(self) -> Any:
        """The ranks that must cut the model alike: the pipeline group, or every rank of a mesh (None: the
        world), so that the replicas of a stage hold the same layers."""
        return self.group if self.hybrid is None else None


@dataclass
class Parts:
    """This rank's stages as a frontend built them.

    ``modules[s]``: the modules local stage ``s`` applies, in order.
    ``register(root)``: puts them on the Pipeline under their one-process names
    (so ``state_dict()`` keys match the one-process model's).
    ``layer_ranges[s]``: which layers (or blocks) of the source stage ``s`` holds.
    ``tied``: the builder of :class:`~stagewise.Tied` modules (None: no ties).
    ``aliases``: the names ``named_parameters`` gives parameters registered under another name (see the field).
    ``seeded``: every replica built the same weights from the same seed; when False (a model built by the
    user), replicas over ``parallel=``'s data, sharding and tensor axes are made equal by a broadcast from
    the first, as torch's DistributedDataParallel does.
    """

    modules: dict[int, list[nn.Module]]
    register: Callable[[nn.Module], None]
    layer_ranges: list[range]
    profile: LayerProfile | None = None
    model_cut: Any = None
    tied: TiedBuilder | None = None
    tied_copies: dict[str, nn.Module] = field(default_factory=dict)
    seeded: bool = False
    #: a parameter registered here under a name of its own that one process lists under another's (a transformers
    #: head tied to the embedding, held without it: ``lm_head.weight`` is ``model.embed_tokens.weight``)
    aliases: dict[str, str] = field(default_factory=dict)


@runtime_checkable
class Frontend(Protocol):
    """A way into a Pipeline."""

    @property
    def entry(self) -> str:
        """How the user called, for messages: ``"Pipeline(layers)"``, ``"Pipeline.from_hf"``, ..."""
        ...

    @property
    def refused(self) -> Mapping[str, str]:
        """Options this way in cannot apply, and why (refused when given: :func:`..options.check_applicable`)."""
        ...

    def defaults(self, options: Options) -> Options:
        """``options`` with this way in's own defaults filled in (options the user did not give)."""
        ...

    def stage_count(self, options: Options) -> int | None:
        """The number of stages the source fixes (a tagged model's), or None: the schedule decides."""
        ...

    def build(self, ctx: PipelineContext, options: Options) -> Parts:
        """This rank's stages for ``ctx`` (called once the context is resolved and checked)."""
        ...


#: why a model built before the Pipeline cannot take the options that build or cut layers
BUILT_MODEL = "the model's weights exist already (seed it before you build it; with parallel= its replicas are made equal by a broadcast from the first)"  # noqa: E501
LAYERS_ONLY = "applies to models stagewise traces with torch.fx (from_model)"
FROM_MODELS = "applies to from_model / from_hf, which free the other ranks' parts of a model built whole"
