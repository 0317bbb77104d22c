"""``Pipeline.from_model``: an unmodified ``nn.Module`` cut into stages by :func:`stagewise.split_model`, pipelined.

::

    model = GPT(config)                                   # any fx-traceable forward
    model.blocks[6].pipeline_stage = 1                    # tags (or built inside `with sw.stage(k):`) ...
    pipe = sw.Pipeline.from_model(model, loss_fn=F.cross_entropy, schedule="1f1b", microbatches=8)
    pipe = sw.Pipeline.from_model(model, stages=4, partition="time", sample_inputs=x[:4], ...)  # ... or no tags

A tagged model is cut at its tags. An untagged one is cut among its top-level
blocks (``embed, blocks.0 .. blocks.11, head``) by ``partition``: the modes
of a layer list, with blocks for layers (:func:`stagewise.partition.modes.stage_counts`);
``"time"`` and ``"memory"`` profile the blocks on ``sample_inputs`` (one
micro-batch) on the group's first rank (:mod:`.balance`).

Stage k runs ``stage_k(*values) -> tuple``: what crosses a cut is whatever
the traced graph needs later (tensors, ints such as ``x.size(0)``, values
that skip stages and are passed through the stages in between), under the
runtime's calling convention. The Pipeline holds this rank's stage modules
under their names in the model (``blocks.3.attn.qkv.weight``), so its
``state_dict()`` is this rank's slice of ``model.state_dict()``.

Memory: the user builds the whole model on every rank. With ``free_unused``
(the default) each rank moves the parameters and buffers of the other ranks'
stages to the meta device, freeing them; the model is then only usable
through the Pipeline (``deepcopy`` it first to keep a one-process twin). To
never allocate other stages at all, give the Pipeline a list of
:class:`~stagewise.Layer` specs instead.

Tied parameters (one parameter used on several stages: ``head.weight =
embed.weight``) are held by every rank owning a stage that uses them and
their gradients are summed over those ranks at SYNC, as for
:class:`~stagewise.Tied` (:mod:`.ties`); each name is saved once.

Limits: inputs are positional (a tensor, or a tuple of arguments); a
non-tensor value crossing a cut must be the same at every step for a given
micro-batch (call ``reset_shapes()`` when it changes).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING, Any

from torch import fx, nn

from ...ir import Schedule
from ...partition import PartitionSpec, check_options, needs_profile, stage_counts
from ..comm import groups
from ..context import PipelineContext, resolve_context, resolve_schedule
from ..measure.profiling import LayerProfile, model_blocks, profile_blocks, steadiest
from ..options import RunOptions
from .balance import ROUNDS, caps_explained, in_flight, on_first_rank, per_stage
from .split import SplitError, collect_tags, split_model
from .split.trace import first_calls, trace
from .stages import BuiltStages
from .ties import found_ties, save_once, unsaved_names

if TYPE_CHECKING:
    from ..pipeline import Pipeline

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelCut:
    """Where a model was cut (``Pipeline.model_cut``), the same on every rank.

    ``stage_inputs[k]``: the values entering stage k, by graph node name (stage
    0: the model's arguments); ``module_stages``: module name -> stage (the
    tags, or the blocks as partitioned); ``blocks``: the top-level blocks an
    untagged model was cut among, in call order (``layer_ranges`` index them).
    """

    stage_inputs: tuple[tuple[str, ...], ...]
    module_stages: dict[str, int]
    blocks: tuple[str, ...]


def from_model(
    cls: type[Pipeline],
    model: nn.Module,
    *,
    stages: int | None = None,
    partition: PartitionSpec | None = None,
    sample_inputs: Any = None,
    speeds: Sequence[float] | None = None,
    memory_caps: Sequence[float] | None = None,
    concrete_args: dict[str, Any] | None = None,
    free_unused: bool = True,
    schedule: str | Schedule = "1f1b",
    microbatches: int | None = None,
    virtual_stages: int | None = None,
    group: Any = None,
    device: Any = None,
    **options: Any,
) -> Pipeline:
    """A :class:`~stagewise.Pipeline` of ``model``, cut at its tags or (untagged) into ``stages`` among its blocks.

    ``stages`` defaults to the schedule's stage count; with a schedule name
    and no ``virtual_stages``, ``stages`` divided by the group size gives the
    virtual stages per rank (4 stages on 2 ranks with ``"zb-v"``). A tagged
    model's stage count is its largest tag + 1. ``partition`` (untagged
    only): ``"uniform"`` (default), ``"parameters"``, ``"time"``,
    ``"memory"`` or block counts per stage; ``speeds`` and ``memory_caps``
    (bytes) are per rank, as for a layer list. ``concrete_args`` goes to
    torch.fx. ``free_unused``: free the other ranks' stages of ``model``
    (see the module docstring). Every other option (``loss_fn``,
    ``optimizer``, ``device``, ``batch_dim``, ``timeout``, ...) is the
    Pipeline's.
    """
    _refuse(model, options)
    options = {k: v for k, v in options.items() if k not in ("parallel", "tp_plan")}
    tags = collect_tags(model)
    if tags:
        stages = _tagged_stages(tags, stages, partition, speeds, memory_caps)
    source = "tags" if tags else ""
    ctx, run = frontend_context(schedule, stages, microbatches, virtual_stages, group, device, options, source)
    sched, pg = ctx.schedule, ctx.group
    n = sched.num_stages
    measured: LayerProfile | None = None
    if tags:
        split = split_model(model, concrete_args=concrete_args)
        counts = [1] * n
    else:
        how = partition or "uniform"
        counts, measured = _block_counts(
            model, sched, how, sample_inputs, speeds, memory_caps, concrete_args, pg, (run.timeout, run.store)
        )
        split = split_model(model, stages=n, partition=counts, concrete_args=concrete_args)
    mine = {k: split.stage_modules[k] for k in ctx.local_stages}
    starts = [sum(counts[:k]) for k in range(n + 1)]
    tied = found_ties(model, split.tied, starts[:-1])  # a parameter used on several stages: summed as sw.Tied
    unsaved = unsaved_names(split.stage_modules, split.tied, sched.placement, ctx.rank, model)
    if free_unused:
        free_unheld(model, mine.values())
    names = sorted({name for gm in split.stage_modules for name in _attributes(gm)})
    cut = ModelCut(split.stage_inputs, dict(split.module_stages), split.blocks)
    del split  # it holds every stage; this rank keeps its own only
    transient = non_persistent(model)

    def register(root: nn.Module) -> None:
        _adopt(root, mine, names, transient)
        save_once(root, unsaved)

    parts = BuiltStages(
        modules={k: [gm] for k, gm in mine.items()},
        register=register,
        layer_ranges=[range(a, b) for a, b in zip(starts, starts[1:])],  # blocks (untagged) or stage modules
        profile=measured,
        model_cut=cut,
        tied=tied,
    )
    return cls._from_parts(ctx, parts, run)


def _refuse(model: Any, options: dict[str, Any]) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"from_model needs an nn.Module, got {type(model).__name__}")
    if "seed" in options or "layers" in options:
        raise TypeError("from_model trains the model's own parameters: seed= and layers= apply to Layer lists only")
    if options.get("parallel") is not None or options.get("tp_plan") is not None:
        raise NotImplementedError(
            "from_model does not support parallel= / tp_plan= yet; give the Pipeline a list of layers for "
            "hybrid parallelism"
        )


def _tagged_stages(
    tags: dict[str, int],
    stages: int | None,
    partition: PartitionSpec | None,
    speeds: Sequence[float] | None,
    memory_caps: Sequence[float] | None,
) -> int:
    """A tagged model's stage count (its largest tag + 1); options that choose cut points do not apply."""
    if partition is not None or speeds is not None or memory_caps is not None:
        raise SplitError(
            f"the model has pipeline_stage tags ({len(tags)} modules), so partition=, speeds= and memory_caps= "
            "do not apply; remove the tags to let from_model choose cut points"
        )
    tagged = max(tags.values()) + 1
    if stages is not None and stages != tagged:
        raise ValueError(f"stages={stages}, but the model's tags name {tagged} stages (0 to {tagged - 1})")
    return tagged


def frontend_context(
    schedule: str | Schedule,
    stages: int | None,
    microbatches: int | None,
    virtual_stages: int | None,
    group: Any,
    device: Any,
    options: dict[str, Any],
    source: str = "",
) -> tuple[PipelineContext, RunOptions]:
    """A frontend's context (the schedule for ``stages`` stages on the group) and its options, checked before
    anything communicates."""
    run = RunOptions(**options)
    groups.require_initialized()
    size = groups.group_size(groups.group_or_world(group))
    sched = schedule_for_stages(schedule, size, stages, microbatches, virtual_stages, source)
    ctx = resolve_context(
        schedule=sched, microbatches=None, virtual_stages=None, group=group, device=device,
        optimizer_steps=run.step_placement,
    )  # fmt: skip
    return ctx, run


def free_unheld(model: nn.Module, held: Iterable[nn.Module]) -> None:
    """Free ``model``'s parameters and buffers that none of the ``held`` modules uses (:func:`free_other_stages`)."""
    keep = {id(t) for m in held for t in chain(m.parameters(), m.buffers())}
    log.info("stagewise: freed %.1f MB of other ranks' stages", free_other_stages(model, keep) / 2**20)


def schedule_for_stages(
    schedule: str | Schedule,
    num_ranks: int,
    stages: int | None,
    microbatches: int | None,
    virtual_stages: int | None,
    source: str,
) -> Schedule:
    """The schedule to run, with as many stages as the model is cut into."""

    what = f"the model's {source} name {stages} stages" if source else f"stages={stages}"
    if isinstance(schedule, str) and stages is not None and virtual_stages is None:
        if stages % num_ranks:
            raise ValueError(f"{what}, which do not divide evenly over {num_ranks} ranks")
        try:
            return resolve_schedule(schedule, num_ranks, microbatches, stages // num_ranks)
        except ValueError as err:
            raise ValueError(
                f"{what} on {num_ranks} ranks ({stages // num_ranks} per rank), which schedule {schedule!r} "
                f"cannot run: {err}"
            ) from err
    sched = resolve_schedule(schedule, num_ranks, microbatches, virtual_stages)
    if stages is not None and sched.num_stages != stages:
        raise ValueError(f"{what}, but schedule {sched.name!r} on {num_ranks} ranks runs {sched.num_stages} stages")
    return sched


def _block_counts(
    model: nn.Module,
    sched: Schedule,
    how: PartitionSpec,
    sample_inputs: Any,
    speeds: Sequence[float] | None,
    memory_caps: Sequence[float] | None,
    concrete_args: dict[str, Any] | None,
    group: Any,
    deadline: tuple[float, Any] = (300.0, None),
) -> tuple[list[int], LayerProfile | None]:
    """How many top-level blocks each stage gets, the same on every rank; and the profile it came from."""
    named = dict(model_blocks(model))
    blocks = first_calls(trace(model, set(named), concrete_args).graph, list(named))
    n, num_stages = len(blocks), sched.num_stages
    if n < num_stages:
        raise SplitError(
            f"{num_stages} stages need at least {num_stages} top-level blocks; the model calls {n}: {blocks}"
        )
    stage_speeds, caps = per_stage(sched, speeds, memory_caps)
    check_options(n, num_stages, how, stage_speeds, caps, unit="block")
    measured = None
    if needs_profile(how, memory_caps):
        if sample_inputs is None:
            raise ValueError(f"partition={how!r} profiles the model's blocks: pass sample_inputs= (one micro-batch)")
        args = sample_inputs if isinstance(sample_inputs, tuple) else (sample_inputs,)
        measured = on_first_rank(
            group,
            lambda: steadiest(lambda: profile_blocks(model, [(b, named[b]) for b in blocks], args), ROUNDS),
            "profiling the model's blocks",
            *deadline,  # the pipeline's timeout and store
        )
    with caps_explained(sched, memory_caps):
        counts = stage_counts(
            n,
            num_stages,
            how,
            parameters=lambda: [float(sum(p.numel() for p in named[b].parameters())) for b in blocks],
            profile=measured,
            speeds=stage_speeds,
            memory_caps=caps,
            in_flight=in_flight(sched),
            unit="block",
        )
    log.info("stagewise: %s partition of %d blocks over %d stages: %s", how, n, num_stages, counts)
    return counts, measured


def free_other_stages(model: nn.Module, keep: set[int]) -> int:
    """Move every parameter and buffer of ``model`` not in ``keep`` (ids) to the meta device; bytes freed."""
    freed = 0
    for module in model.modules():
        for store in (module._parameters, module._buffers):
            for name, t in list(store.items()):
                if t is None or id(t) in keep or t.is_meta:
                    continue
                freed += t.numel() * t.element_size()
                meta = t.detach().to("meta")
                store[name] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return freed


def non_persistent(model: nn.Module) -> set[str]:
    """Qualified names of the model's non-persistent buffers (fx registers every buffer it copies as persistent)."""
    return {f"{m}.{b}" if m else b for m, module in model.named_modules() for b in module._non_persistent_buffers_set}


def _attributes(module: nn.Module) -> list[str]:
    return list(chain(module._modules, module._parameters, module._buffers))


def _adopt(pipe: nn.Module, mine: dict[int, fx.GraphModule], names: list[str], transient: set[str]) -> None:
    """Register this rank's stage modules' contents on the Pipeline under the model's names (not ``stage3``)."""
    clashes = [name for name in names if hasattr(pipe, name)]
    if clashes:
        raise ValueError(f"the model's attributes {clashes} clash with Pipeline attributes; rename them")
    for gm in mine.values():
        _merge(pipe, gm)
    for qualname, module in pipe.named_modules():
        for b in module._buffers:
            if (f"{qualname}.{b}" if qualname else b) in transient:
                module._non_persistent_buffers_set.add(b)


def _merge(dst: nn.Module, src: nn.Module) -> None:
    """Add what ``src`` holds to ``dst``; where both hold a different module of one name, merge those and make
    ``src`` use ``dst``'s (so two stages on one rank share one container, as in the model)."""
    for name, p in src._parameters.items():
        if dst._parameters.get(name) is None:
            dst.register_parameter(name, p)
    for name, b in src._buffers.items():
        if name not in dst._buffers:
            dst.register_buffer(name, b)
    for name, child in list(src._modules.items()):
        have = dst._modules.get(name)
        if have is None:
            dst.add_module(name, child)
        elif have is not child and child is not None:
            _merge(have, child)
            src._modules[name] = have
