"""``Pipeline.from_hf``: any Hugging Face decoder-only causal LM pipelined in one call, exact or refused.

::

    model = AutoModelForCausalLM.from_config(config)          # or from_pretrained(...)
    pipe = sw.Pipeline.from_hf(model, schedule="1f1b", microbatches=8)
    loss = pipe.train_step((input_ids, attention_mask), labels)  # HF's loss: shifted, -100 ignored

Why not ``from_model``: transformers' forwards cannot be traced by torch.fx or torch.export as a whole. But
a decoder-only causal LM is some work, a list of decoder layers, and some more work. So the decoder layers
are the units of the cut (the embedding goes with the first, the head with the last) and any partition mode
of a layer list applies; each stage runs the model's *own* forward with the other stages' layers skipped
(:mod:`.stage`), so no family's arithmetic is written here. How the layers are found: :mod:`.discover`.

**The equivalence check** (:mod:`.check`): at construction, before any rank communicates, the model is
cut into one piece per layer, the pieces are chained on a tiny batch in the model's dtype and compared with
the model's own outputs; a model whose pieces stray is refused, naming the first piece that does.
``Pipeline.from_hf(model, check=False)`` skips it, for a model too big to run once on every rank::

    pipe = sw.Pipeline.from_hf(model, check=False, schedule="1f1b")

**Inputs**: ``input_ids``; ``(input_ids, attention_mask[, position_ids])``; or a tokenizer's dict of those.
The mask may be 2-D (padding, left or right) or 4-D; position ids that restart per packed document isolate
the documents as ``model(..., use_cache=False)`` does (the reference: training runs without a cache).

Names: every module is registered on the Pipeline under its name in the model
(``model.layers.3.mlp.up_proj.weight``), so ``state_dict()`` keys are a subset of ``model.state_dict()``'s
and a checkpoint loads back with ``load_state_dict`` or ``from_pretrained``. A tied embedding and head (the
config's ``tie_word_embeddings``) are one :class:`~stagewise.Tied` key: their gradients are summed over the
ranks holding them at SYNC; a rank holding the head without the embedding keeps it as ``lm_head.weight`` in
``state_dict()`` and lists it under the embedding's name in ``named_parameters()``, as one process does.

The loss (default) is transformers' causal-LM loss, :func:`stagewise.causal_lm_loss`, weighted by
:func:`stagewise.count_tokens`: the mean over the non-ignored tokens of the whole batch (of every
data-parallel replica too), however unevenly they fall over the micro-batches. With ``parallel=`` and
``tp > 1`` the tensor-parallel plan defaults to the config's ``base_model_tp_plan`` (:mod:`.tp_plan`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch import nn

from ....partition import stages_per_rank_note
from ...losses import causal_lm_loss, count_tokens
from ..balance import plan_layers
from ..from_model import free_unheld
from ..meta_twin import given_storage
from ..parts import BUILT_MODEL, LAYERS_ONLY, Parts
from ..tied import Tied, TiedBuilder
from .check import check_model
from .discover import Layout, decoder_layers, recognise
from .profile import loss_measure
from .stage import HFStage, decoder_units
from .tp_plan import default_tp_plan

if TYPE_CHECKING:
    from ...options import Options
    from ..parts import PipelineContext

__all__ = ["FromHF", "HFStage", "Layout", "check_model", "recognise"]

log = logging.getLogger(__name__)


class FromHF:
    """``Pipeline.from_hf(model, ...)``: a transformers causal LM, cut among its decoder layers.

    ``check``: run the equivalence check (:mod:`.check`) at construction; False skips it.
    """

    entry = "Pipeline.from_hf"
    refused = {"seed": BUILT_MODEL, "concrete_args": LAYERS_ONLY}
    #: the build's default cut (by parameters) is a stand-in the first batch replaces with the counted one
    #: (:mod:`..first_batch`): attention's work over the sequence's square is in no parameter count
    cut_at_first_batch = True

    def __init__(self, model: nn.Module, *, check: bool = True) -> None:
        self.layout = recognise(model)
        self.model = model
        self.num_layers = len(decoder_layers(model, self.layout))
        self.checked = check_model(model, self.layout) if check else None

    def defaults(self, options: Options) -> Options:
        """The loss defaults to transformers' causal-LM loss, averaged over the batch's counted tokens; the
        tensor-parallel plan to the config's own (``base_model_tp_plan``)."""
        if not options.is_given("loss_fn"):
            options = options.with_defaults(loss_fn=causal_lm_loss, loss_weights=count_tokens)
        if not options.is_given("tp_plan") and _tp_degree(options.parallel) > 1:
            options = options.with_defaults(tp_plan=default_tp_plan(self.model, self.layout))
        return options

    def stage_count(self, options: Options) -> int | None:
        return None

    def loss_measure(self, options: Options) -> Callable[[Any], float | None] | None:
        """How a profiled cut measures the loss's kept bytes (:func:`.profile.loss_measure`: the ids as labels)."""
        return loss_measure(options.sample_inputs, options.loss_fn)

    def units(self) -> list[tuple[str, HFStage]]:
        """The units of the cut (:func:`.stage.decoder_units`), named by index."""
        return decoder_units(self.model, self.layout)

    def build(self, ctx: PipelineContext, options: Options) -> Parts:
        model, layout, n = self.model, self.layout, self.num_layers
        sched = ctx.schedule
        if n < sched.num_stages:
            why = stages_per_rank_note(sched.name, sched.num_ranks, sched.virtual_stages, "decoder layer")
            raise ValueError(
                f"{sched.num_stages} stages need at least {sched.num_stages} decoder layers; "
                f"{layout.kind} has {n} ({layout.layers}){why}"
            )
        units = self.units()
        plan = plan_layers(
            units,
            sched,
            options.partition,
            group=ctx.cut_group,
            device=ctx.device,
            seed=0,
            sample_inputs=options.sample_inputs,
            speeds=options.speeds,
            memory_caps=options.caps,
            timeout=options.timeout,
            store=options.store,
            has_loss=options.loss_fn is not None,
            measure_loss=self.loss_measure(options),
        )
        del units
        last = sched.num_stages - 1
        mine = {s: HFStage(model, layout, plan.ranges[s], first=s == 0, last=s == last) for s in ctx.local_stages}
        held = [name for st in mine.values() for _, name in st.names]
        tied = _ties(model, layout, n)  # before freeing: every rank must know the tie (its groups are made by all)
        kept = [*mine.values(), *(m for st in mine.values() for m in st.kept)]
        if options.free_unused:
            free_unheld(model, kept)
        given_storage(kept, model, ctx.device)  # (a re-layout's build from a meta twin: filled after)
        log.info(
            "stagewise: rank %d holds stages %s (decoder layers %s) of %s",
            ctx.rank,
            list(ctx.local_stages),
            [f"{plan.ranges[s].start}..{plan.ranges[s].stop - 1}" for s in ctx.local_stages],
            layout.kind,
        )
        return Parts(
            modules={s: [st] for s, st in mine.items()},
            register=lambda root: _register(root, model, held),
            layer_ranges=plan.ranges,
            profile=plan.profile,
            tied=tied,
            aliases=_head_alias(layout, held) if tied is not None else {},
        )


def _tp_degree(parallel: Any) -> int:
    if parallel is None:
        return 1
    config = getattr(parallel, "config", parallel)  # a Mesh carries its ParallelConfig
    return int(getattr(config, "tp", 1))


def _ties(model: nn.Module, layout: Layout, n: int) -> TiedBuilder | None:
    """The embedding and the head as one tied key when they share their weight (and live in different units)."""
    embed, head = model.get_submodule(layout.embed), model.get_submodule(layout.head)
    if n < 2 or getattr(head, "weight", None) is not embed.weight:
        return None
    named: list[tuple[str, Any]] = [(str(i), nn.Identity()) for i in range(n)]
    named[0] = ("0", Tied("embed", embed))
    named[-1] = (str(n - 1), Tied("embed"))
    return TiedBuilder(named, 0)


def _head_alias(layout: Layout, held: list[str]) -> dict[str, str]:
    """A rank holding the tied head without the embedding lists its weight under the embedding's name, as
    ``model.named_parameters()`` does (it lists a tied weight once, under its first name): an optimizer's groups
    built by name (no decay on "embed"...) then treat the copies alike, which stay equal only if they do."""
    if layout.head in held and layout.embed not in held:
        return {f"{layout.head}.weight": f"{layout.embed}.weight"}
    return {}


def _register(root: nn.Module, model: nn.Module, held: list[str]) -> None:
    """Put the held modules on the Pipeline under their names in the model (containers made as needed)."""
    for name in dict.fromkeys(held):
        *path, leaf = name.split(".")
        parent = root
        for k, part in enumerate(path):
            child = parent._modules.get(part)
            if child is None:
                if hasattr(parent, part):
                    where = ".".join(path[: k + 1])
                    raise ValueError(f"the model's module {where!r} clashes with a Pipeline attribute")
                child = nn.Module()
                parent.add_module(part, child)
            parent = child
        parent.add_module(leaf, model.get_submodule(name))
