"""``Pipeline.from_model``: an unmodified ``nn.Module`` cut into stages (:func:`stagewise.runtime.split_model`).

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
:class:`~stagewise.Tied` (:mod:`.ties`); each name is saved once. A block
reaching another rank's parameter through a reference outside its module
tree is refused at its stage's first forward (:mod:`.unheld`).

Limits: inputs are positional (a tensor, or a tuple of arguments); a
non-tensor value crossing a cut must be the same at every step for a given
micro-batch (call ``reset_shapes()`` when it changes).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from itertools import chain
from typing import TYPE_CHECKING, Any

from torch import fx, nn

from ...ir import Schedule
from ...partition import check_options, needs_profile, stage_counts, stages_per_rank_note
from ...partition.modes import DEFAULT
from ..comm import groups
from ..measure.profiling import LayerProfile, model_blocks, profile_blocks, steadiest
from . import default_cut
from .balance import ROUNDS, caps_explained, in_flight, on_first_rank, per_stage
from .layer_timing import with_loss_bytes
from .meta_twin import given_storage
from .parts import BUILT_MODEL, Parts
from .split import SplitError, collect_tags, split_model
from .split.trace import first_calls, trace
from .tied import TiedCall
from .ties import found_ties, save_once, tie_aliases, tied_layers, unsaved_names
from .unheld import watch_first_forward

if TYPE_CHECKING:
    from ..options import Options
    from .parts import PipelineContext

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


class FromModel:
    """``Pipeline.from_model(model, ...)``: an unmodified module, cut at its tags or among its top-level blocks."""

    entry = "Pipeline.from_model"
    refused = {"seed": BUILT_MODEL}

    def __init__(self, model: nn.Module) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"from_model needs an nn.Module, got {type(model).__name__}")
        if _is_transformers_model(model):
            raise TypeError(
                f"from_model traces a model with torch.fx, which transformers' forwards do not survive; "
                f"{type(model).__name__} is a transformers model: use Pipeline.from_hf(model, ...) (causal LMs)"
            )
        declared = [name for name, m in model.named_modules() if isinstance(m, TiedCall)]
        if declared:
            raise ValueError(
                f"from_model: the model holds sw.Tied uses ({', '.join(declared)}), which only a layer list reads; "
                "tie a built model's weights as PyTorch does (head.weight = embed.weight) and from_model finds them, "
                "or give the layer list to Pipeline(layers)"
            )
        self.model = model
        self.tags = collect_tags(model)

    def defaults(self, options: Options) -> Options:
        if self.tags:
            chosen = [n for n in ("partition", "speeds", "memory_caps") if options.is_given(n)]
            if chosen:
                verb = "does" if len(chosen) == 1 else "do"
                raise SplitError(
                    f"the model has pipeline_stage tags ({len(self.tags)} modules), so "
                    f"{', '.join(n + '=' for n in chosen)} {verb} not apply; remove the tags to let from_model "
                    "choose cut points"
                )
        return options

    def stage_count(self, options: Options) -> int | None:
        return max(self.tags.values()) + 1 if self.tags else None

    def build(self, ctx: PipelineContext, options: Options) -> Parts:
        model, sched = self.model, ctx.schedule
        n = sched.num_stages
        measured: LayerProfile | None = None
        if self.tags:
            split = split_model(model, concrete_args=options.concrete_args)
            counts = [1] * n
        else:
            counts, measured = _block_counts(model, sched, options, ctx.cut_group, ctx.device.type)
            split = split_model(model, stages=n, partition=counts, concrete_args=options.concrete_args)
        mine = {k: split.stage_modules[k] for k in ctx.local_stages}
        starts = [sum(counts[:k]) for k in range(n + 1)]
        tied = found_ties(model, tie_units(model, split.tied, split.blocks, starts))  # summed as sw.Tied
        unsaved = unsaved_names(split.stage_modules, split.tied, sched.placement, ctx.rank, model)
        aliases = tie_aliases(mine.values(), split.tied, model)  # listed under the first name, as one process does
        if options.free_unused:
            free_unheld(model, mine.values())
        given_storage(mine.values(), model, ctx.device)  # (a re-layout's build from a meta twin: filled after)
        names = sorted({name for gm in split.stage_modules for name in _attributes(gm)})
        cut = ModelCut(split.stage_inputs, dict(split.module_stages), split.blocks)
        watch_first_forward(mine, model, cut.module_stages)  # a parameter used here but held by another rank
        del split  # it holds every stage; this rank keeps its own only
        transient = non_persistent(model)

        def register(root: nn.Module) -> None:
            _adopt(root, mine, names, transient)
            save_once(root, unsaved)

        return Parts(
            modules={k: [gm] for k, gm in mine.items()},
            register=register,
            layer_ranges=[range(a, b) for a, b in zip(starts, starts[1:])],  # blocks (untagged) or stage modules
            profile=measured,
            model_cut=cut,
            tied=tied,
            aliases=aliases,
        )


def tie_units(
    model: nn.Module, ties: Mapping[str, Sequence[int]], blocks: Sequence[str], starts: Sequence[int]
) -> dict[str, list[int]]:
    """Each tied parameter's (first name -> stages using it) use on each stage as a unit index: the stage's block
    that holds it, as the profile's ``tied`` names it (:func:`.ties.tied_layers`), so a calibration finds the
    measured bytes of the set the run sums; the stage's first unit where none does (a use in the model's own
    code between blocks, or a tagged model, whose units are its stages)."""

    def unit(param: nn.Parameter, k: int) -> int:
        holders = range(starts[k], min(starts[k + 1], len(blocks)))
        held = (i for i in holders if any(p is param for p in model.get_submodule(blocks[i]).parameters()))
        return next(held, starts[k])

    return {name: [unit(model.get_parameter(name), k) for k in stages] for name, stages in ties.items()}


def _is_transformers_model(model: nn.Module) -> bool:
    """A transformers ``PreTrainedModel`` (by its classes' modules: transformers is not imported for this)."""
    return any(c.__module__.split(".")[0] == "transformers" for c in type(model).__mro__)


def free_unheld(model: nn.Module, held: Iterable[nn.Module]) -> None:
    """Free ``model``'s parameters and buffers that none of the ``held`` modules uses (:func:`free_other_stages`)."""
    keep = {id(t) for m in held for t in chain(m.parameters(), m.buffers())}
    log.info("stagewise: freed %.1f MB of other ranks' stages", free_other_stages(model, keep) / 2**20)


def _block_counts(
    model: nn.Module, sched: Schedule, options: Options, group: Any, device: str = "cpu"
) -> tuple[list[int], LayerProfile | None]:
    """How many top-level blocks each stage gets, the same on every rank; and the profile it came from. The
    default (``"balanced"``) is the layer list's default cut over the blocks (:func:`.default_cut.decide`:
    counted on ``sample_inputs`` chained block to block, else parameters, evenly over convolutions; refined for
    the schedule; rank 0 decides; the word)."""
    how, speeds, memory_caps = options.partition, options.speeds, options.caps
    sample_inputs, concrete_args = options.sample_inputs, options.concrete_args
    named = dict(model_blocks(model))
    blocks = first_calls(trace(model, set(named), concrete_args).graph, list(named))
    n, num_stages = len(blocks), sched.num_stages
    if n < num_stages:
        why = stages_per_rank_note(sched.name, sched.num_ranks, sched.virtual_stages, "top-level block")
        raise SplitError(
            f"{num_stages} stages need at least {num_stages} top-level blocks; the model calls {n}: {blocks}{why}"
        )
    stage_speeds, caps = per_stage(sched, speeds, memory_caps)
    check_options(n, num_stages, how, stage_speeds, caps, unit="block")
    measured = None
    if how == DEFAULT and memory_caps is None:
        cut = _default_cut([(b, named[b]) for b in blocks], sched, options, group, stage_speeds, device)
        log.info("stagewise: %s partition of %d blocks over %d stages: %s", how, n, num_stages, cut.counts)
        return cut.counts, cut.profile  # (the counted or timed blocks: what a calibration of the run scales)
    if needs_profile(how, memory_caps):
        if sample_inputs is None:
            raise ValueError(f"partition={how!r} profiles the model's blocks: pass sample_inputs= (one micro-batch)")
        args = sample_inputs if isinstance(sample_inputs, tuple) else (sample_inputs,)
        units = [(b, named[b]) for b in blocks]

        def measure() -> LayerProfile:  # the blocks sharing a parameter recorded too (one block's own: no tie)
            timed = steadiest(lambda: profile_blocks(model, units, args), ROUNDS)
            return replace(timed, tied=tied_layers([m for _, m in units]))

        measured = on_first_rank(group, measure, "profiling the model's blocks", options.timeout, options.store)
        measured = with_loss_bytes(measured, options.loss_fn is not None)  # (as a layer list's: balance.plan_layers)
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
            placement=sched.placement,
        )
    log.info("stagewise: %s partition of %d blocks over %d stages: %s", how, n, num_stages, counts)
    return counts, measured


def _default_cut(
    blocks: list[tuple[str, nn.Module]],
    sched: Schedule,
    options: Options,
    group: Any,
    stage_speeds: list[float] | None,
    device: str,
) -> default_cut.DefaultCut:
    """``partition="balanced"`` over the blocks: the group's first rank decides, every rank takes its cut."""

    def decided() -> dict[str, Any]:
        cut = default_cut.decide(
            blocks, sched, sample_inputs=options.sample_inputs, speeds=stage_speeds, seed=0, device=device
        )
        return default_cut.plain(cut)

    what = "cutting the model's blocks (partition='balanced')"
    cut = default_cut.unplain(on_first_rank(group, decided, what, options.timeout, options.store))
    default_cut.warn_if_slower(sched, cut, groups.group_rank(group), device)
    return cut


def free_other_stages(model: nn.Module, keep: set[int]) -> int:
    """Move every parameter and buffer of ``model`` not in ``keep`` (ids) to the meta device; bytes freed. A tensor
    several modules hold stays one (meta) tensor, so the model's ties stay visible (a re-layout cuts it again)."""
    freed = 0
    made: dict[int, Any] = {}
    for module in model.modules():
        for store in (module._parameters, module._buffers):
            for name, t in list(store.items()):
                if t is None or id(t) in keep or (t.is_meta and id(t) not in made):
                    continue
                if id(t) not in made:
                    freed += t.numel() * t.element_size()
                    meta = t.detach().to("meta")
                    made[id(t)] = nn.Parameter(meta, t.requires_grad) if isinstance(t, nn.Parameter) else meta
                store[name] = made[id(t)]
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
