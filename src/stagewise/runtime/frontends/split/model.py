"""split_model: an unmodified nn.Module, cut into pipeline stages at its tags or at balanced block boundaries."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import fx, nn
from torch.utils._pytree import tree_leaves

from ....partition import Partition, needs_profile, stage_counts
from ...measure.profiling import LayerProfile, model_blocks, preserved_state, profile_blocks
from ..ties import tied_layers
from .cut import cut, shared_parameters
from .tags import collect_tags
from .trace import SplitError, assign_stages, first_calls, tagged_leaves, trace


@dataclass(frozen=True)
class BoundaryValue:
    """One value crossing from stage k to k+1, as seen on the example inputs.

    ``made_on`` is the stage that computes it (-1 for a model input), so a
    value with ``made_on < k`` is passed through stage k. ``kind`` is
    ``"tensor"`` or the Python type name (an int from ``x.size(1)``, a tuple
    returned whole by a module).
    """

    name: str
    made_on: int
    kind: str
    shape: tuple[int, ...] | None
    dtype: torch.dtype | None
    requires_grad: bool
    nbytes: int


@dataclass(frozen=True, eq=False)
class SplitModel:
    """A model cut into stages: ``stage_modules[k](*inputs_of_stage_k) -> tuple`` (the last returns the model's output).

    Stage k's inputs are ``stage_inputs[k]`` (stage 0: the model's own
    arguments) and its outputs are ``stage_inputs[k + 1]``: chained in one
    process, the stages compute exactly what the model does (:meth:`run`).
    Stage modules share the model's modules and parameters and keep their
    qualified names, so ``stage_modules[k].state_dict()`` is a slice of
    ``model.state_dict()`` with the same keys. ``tied``: parameters used on
    several stages (a tied embedding and head), by the model's first name,
    with the stages using them; a Pipeline sums their gradients over the owners.
    """

    stage_modules: tuple[fx.GraphModule, ...]
    stage_inputs: tuple[tuple[str, ...], ...]
    module_stages: dict[str, int]
    traced: fx.GraphModule
    boundaries: tuple[tuple[BoundaryValue, ...], ...] | None = None
    blocks: tuple[str, ...] = ()
    block_partition: Partition | None = None
    profile: LayerProfile | None = field(default=None, repr=False)
    tied: dict[str, tuple[int, ...]] = field(default_factory=dict)

    @property
    def num_stages(self) -> int:
        return len(self.stage_modules)

    def named_parameters(self, k: int) -> Iterator[tuple[str, nn.Parameter]]:
        """Stage k's parameters under their names in the original model (``blocks.3.attn.weight``)."""
        return self.stage_modules[k].named_parameters()

    def parameter_stages(self) -> dict[str, int]:
        """Original parameter name -> the stage that owns it."""
        return {name: k for k in range(self.num_stages) for name, _ in self.named_parameters(k)}

    def boundary_bytes(self) -> list[float]:
        """Bytes each stage sends to the next (0 for the last), measured on the example inputs."""
        if self.boundaries is None:
            raise ValueError("boundary sizes need example_inputs at split time")
        return [float(sum(v.nbytes for v in b)) for b in self.boundaries] + [0.0]

    def run(self, *inputs: Any) -> Any:
        """All stages in sequence in this process: equals ``model(*inputs)``."""
        values: Any = inputs
        for stage in self.stage_modules:
            values = stage(*values)
        return values


def split_model(
    model: nn.Module,
    example_inputs: Any = None,
    *,
    stages: int | None = None,
    partition: str | Sequence[int] | None = None,
    costs: Sequence[float] | LayerProfile | None = None,
    concrete_args: dict[str, Any] | None = None,
    repeats: int = 5,
) -> SplitModel:
    """Cut ``model`` into pipeline stages.

    A model with ``pipeline_stage`` tags (set by hand or by ``with stage(k):``)
    is cut at its tags. An untagged model needs ``stages``: the cut points are
    chosen among its top-level blocks (:func:`stagewise.runtime.measure.profiling.model_blocks`,
    e.g. ``embed, layers.0 .. layers.11, head``) by ``partition``:

    * ``"uniform"`` (default): as many blocks per stage as possible;
    * ``"parameters"``: balance parameter counts;
    * ``"time"``: balance profiled forward + backward time (needs
      ``example_inputs``, or ``costs``: a profile or one number per block in
      call order);
    * a list of block counts per stage.

    ``example_inputs`` (a tensor or a tuple of positional arguments) is also
    run once through the stages to record what crosses each cut
    (``boundaries``). ``concrete_args`` is passed to torch.fx to fix
    Python-valued arguments.
    """
    inputs = (
        None if example_inputs is None else (example_inputs if isinstance(example_inputs, tuple) else (example_inputs,))
    )
    gm, tags, blocks, block_partition, measured = _traced(
        model, collect_tags(model), inputs, stages, partition, costs, concrete_args, repeats
    )
    placed_by = "placed by the partition on" if blocks else "tagged"
    stage_of = assign_stages(gm.graph, tags, stages, placed_by=placed_by)
    num_stages = max(stage_of.values()) + 1 if stages is None else stages
    stage_modules, live = cut(gm, model, stage_of, num_stages)
    made = {**{n.name: -1 for n in gm.graph.nodes if n.op == "placeholder"}, **stage_of}
    split = SplitModel(
        stage_modules=tuple(stage_modules),
        stage_inputs=tuple(live),
        module_stages={name: k for name, k in tags.items()},
        traced=gm,
        blocks=blocks,
        block_partition=block_partition,
        profile=measured,
        tied=shared_parameters(model, stage_modules),
    )
    if inputs is None:
        return split
    return replace(split, boundaries=_record_boundaries(model, split, inputs, made))


def _traced(
    model: nn.Module,
    tags: dict[str, int],
    inputs: tuple[Any, ...] | None,
    stages: int | None,
    partition: str | Sequence[int] | None,
    costs: Sequence[float] | LayerProfile | None,
    concrete_args: dict[str, Any] | None,
    repeats: int,
) -> tuple[fx.GraphModule, dict[str, int], tuple[str, ...], Partition | None, LayerProfile | None]:
    """The model traced, and its modules' stages: its tags, or (untagged) its top-level blocks partitioned into
    ``stages``, with the blocks in call order, their partition and the profile it was balanced on (if any)."""
    if tags:
        if partition is not None or costs is not None:
            raise SplitError(
                f"the model has pipeline_stage tags ({len(tags)} modules), so partition= and costs= do not apply; "
                "remove the tags to let split_model choose cut points"
            )
        return trace(model, tagged_leaves(model, tags), concrete_args), tags, (), None, None
    if stages is None:
        raise SplitError(
            "the model has no pipeline_stage tags: tag submodules (module.pipeline_stage = k or "
            "`with stage(k):`) or pass stages=N to cut it among its top-level blocks"
        )
    named = dict(model_blocks(model))
    gm = trace(model, set(named), concrete_args)
    blocks = tuple(first_calls(gm.graph, list(named)))
    block_partition, measured = _partition_blocks(model, blocks, named, inputs, stages, partition, costs, repeats)
    bounds = block_partition.bounds
    tags = {blocks[i]: k for k in range(stages) for i in range(bounds[k], bounds[k + 1])}
    return gm, tags, blocks, block_partition, measured


def _partition_blocks(
    model: nn.Module,
    blocks: tuple[str, ...],
    named: dict[str, nn.Module],
    inputs: tuple[Any, ...] | None,
    stages: int,
    partition: str | Sequence[int] | None,
    costs: Sequence[float] | LayerProfile | None,
    repeats: int,
) -> tuple[Partition, LayerProfile | None]:
    n = len(blocks)
    if n < stages:
        raise SplitError(
            f"{stages} stages need at least {stages} top-level blocks; the model calls {n}: {list(blocks)}"
        )
    if partition is None:
        partition = "time" if costs is not None else "uniform"
    measured: LayerProfile | None = None
    times: list[float] | None = None
    if isinstance(costs, LayerProfile):
        missing = [b for b in blocks if b not in costs.names]
        if missing:
            raise SplitError(f"the profile has no entry for block(s) {missing}")
        measured = LayerProfile(
            tuple(costs[b] for b in blocks), costs.device, costs.repeats, costs.warmup, tied=_ties_of(costs, blocks)
        )
    elif costs is not None:
        times = [float(c) for c in costs]
    elif needs_profile(partition):
        if inputs is None:
            raise SplitError(f"partition={partition!r} profiles the blocks: pass example_inputs (or costs=)")
        measured = profile_blocks(model, [(b, named[b]) for b in blocks], inputs, repeats=repeats)
        measured = replace(measured, tied=tied_layers([named[b] for b in blocks]))  # (one block's own: no tie)
    try:
        counts = stage_counts(
            n,
            stages,
            partition,
            parameters=lambda: [float(sum(p.numel() for p in named[b].parameters())) for b in blocks],
            profile=measured,
            unit="block",
            times=times,
        )
    except SplitError:
        raise
    except ValueError as err:  # one set of messages for every frontend, raised as this frontend's error
        raise SplitError(str(err)) from err
    return _from_counts(counts), measured


def _ties_of(profile: LayerProfile, blocks: Sequence[str]) -> tuple[tuple[tuple[int, ...], float], ...]:
    """``profile.tied`` by the indices of ``blocks`` (the profile's layers may be in another order, or more): a set
    left with one block is no tie across stages."""
    at = {name: blocks.index(name) for name in profile.names if name in blocks}
    names = profile.names
    out = []
    for layers, nbytes in profile.tied:
        ks = tuple(sorted({at[names[k]] for k in layers if names[k] in at}))
        if len(ks) > 1:
            out.append((ks, nbytes))
    return tuple(out)


def _from_counts(counts: list[int]) -> Partition:
    bounds = [0]
    for c in counts:
        bounds.append(bounds[-1] + c)
    return Partition(bounds=tuple(bounds), stage_costs=tuple(float(c) for c in counts))


def _record_boundaries(
    model: nn.Module, split: SplitModel, inputs: tuple[Any, ...], made: dict[str, int]
) -> tuple[tuple[BoundaryValue, ...], ...]:
    """Run the example through the stages once and describe every value that crosses a cut."""
    result = []
    with preserved_state([model], inputs):
        values: Any = inputs
        for k, stage in enumerate(split.stage_modules[:-1]):
            values = stage(*values)
            names = split.stage_inputs[k + 1]
            result.append(tuple(_describe(name, made[name], v) for name, v in zip(names, values)))
    return tuple(result)


def _describe(name: str, made_on: int, value: Any) -> BoundaryValue:
    if isinstance(value, torch.Tensor):
        return BoundaryValue(
            name=name,
            made_on=made_on,
            kind="tensor",
            shape=tuple(value.shape),
            dtype=value.dtype,
            requires_grad=value.requires_grad,
            nbytes=value.numel() * value.element_size(),
        )
    nbytes = sum(t.numel() * t.element_size() for t in tree_leaves(value) if isinstance(t, torch.Tensor))
    return BoundaryValue(
        name=name,
        made_on=made_on,
        kind=type(value).__name__,
        shape=None,
        dtype=None,
        requires_grad=False,
        nbytes=nbytes,
    )
