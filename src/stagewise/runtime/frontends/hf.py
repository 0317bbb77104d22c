"""``Pipeline.from_hf``: a Hugging Face decoder-only causal LM pipelined in one call.

::

    model = AutoModelForCausalLM.from_config(config)          # or from_pretrained(...)
    pipe = sw.Pipeline.from_hf(model, schedule="1f1b", microbatches=8)
    loss = pipe.train_step((input_ids, attention_mask), labels)  # HF's loss: shifted, -100 ignored

Why not ``from_model``: transformers' forwards cannot be traced by torch.fx or
torch.export as a whole. But every decoder-only causal LM of the common
families has the same shape: a token embedding (plus learned positions for
GPT-2), a list of decoder layers that each take the hidden states, the causal
(+ padding, + sliding-window) attention mask and the positions (or the rotary
cos/sin), then a final norm and the LM head. So the layers are the units of the
cut, the embedding is attached to the first unit and the norm and head to the
last, and any partition mode of a layer list applies
(:func:`stagewise.partition.modes.stage_counts` through :mod:`..model.balance`).

What crosses a cut: ``(hidden_states, attention_mask, position_ids)``: the 2-D
padding mask (or None) and the positions, which need no gradient; each stage
builds the 4-D mask and the rotary cos/sin for its own layers with
transformers' own functions (``create_causal_mask`` and
``create_sliding_window_causal_mask``, the model's ``rotary_emb``), exactly as
the model's forward does, so the results are the one-process model's to float
rounding.

Names: every module is registered on the Pipeline under its name in the model
(``model.layers.3.mlp.up_proj.weight``), so ``state_dict()`` keys are a subset
of ``model.state_dict()``'s and a checkpoint loads back with
``load_state_dict`` or ``from_pretrained``. A tied embedding and head (the
config's ``tie_word_embeddings``: ``lm_head.weight is embed.weight``) are one
:class:`~stagewise.Tied` key: their gradients are summed over the ranks holding
them at SYNC (:class:`..model.tied.TiedSync`); a rank holding the head without
the embedding names the parameter ``lm_head.weight``, as ``model.state_dict()``
does.

The loss (default) is transformers' causal-LM loss,
:func:`stagewise.causal_lm_loss`, weighted by :func:`stagewise.count_tokens`:
the mean over the non-ignored tokens of the whole batch, however unevenly they
fall over the micro-batches.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ...ir import Schedule
from ...partition import PartitionSpec
from ..losses import causal_lm_loss, count_tokens
from .balance import plan_layers
from .from_model import free_unheld, frontend_context
from .stages import BuiltStages
from .tied import Tied, TiedBuilder

if TYPE_CHECKING:
    from ..pipeline import Pipeline

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Layout:
    """Where a family keeps the parts of its causal LM (module names in the ``...ForCausalLM`` model)."""

    family: str
    model_types: tuple[str, ...]  # config.model_type values whose forward is the one this frontend replays
    embed: str
    layers: str
    norm: str
    head: str
    positions: str | None = None  # learned absolute positions (GPT-2)
    rotary: str | None = None  # rotary embedding module, shared by the layers (Llama)
    drop: str | None = None  # dropout after the embedding (GPT-2)

    def parts(self) -> list[str]:
        return [n for n in (self.embed, self.positions, self.rotary, self.layers, self.norm, self.head) if n]


GPT2 = Layout(
    "gpt2", ("gpt2",), "transformer.wte", "transformer.h", "transformer.ln_f", "lm_head",
    positions="transformer.wpe", drop="transformer.drop",
)  # fmt: skip
LLAMA = Layout(
    "llama", ("llama", "mistral", "qwen2", "qwen3"), "model.embed_tokens", "model.layers", "model.norm", "lm_head",
    rotary="model.rotary_emb",
)  # fmt: skip
LAYOUTS = (GPT2, LLAMA)

MASK_KINDS = ("full_attention", "sliding_attention")


def recognise(model: nn.Module) -> Layout:
    """The layout of ``model``, or a ValueError naming what was looked for and what the model has."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"from_hf needs a transformers model (an nn.Module), got {type(model).__name__}")
    config = getattr(model, "config", None)
    kind = type(model).__name__
    if config is None:
        raise ValueError(f"from_hf needs a transformers model with a .config; {kind} has none")
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(
            f"from_hf pipelines decoder-only causal LMs; {kind} is an encoder-decoder model "
            "(config.is_encoder_decoder is True)"
        )
    if getattr(config, "add_cross_attention", False):
        raise ValueError(f"from_hf pipelines decoder-only causal LMs; {kind} has cross-attention layers")
    have = {n for n, _ in model.named_modules()}
    looked = "; ".join(f"{lay.family}: {', '.join(lay.parts())}" for lay in LAYOUTS)
    for lay in LAYOUTS:
        if all(p in have for p in lay.parts()):
            model_type = getattr(config, "model_type", None)
            if model_type not in lay.model_types:
                raise ValueError(
                    f"{kind} (model_type {model_type!r}) has the {lay.family} layout, but from_hf replays the "
                    f"forward of model types {list(lay.model_types)} only; others may compute differently "
                    "(embedding scales, extra norms)"
                )
            return lay
    top = sorted(n for n in have if n and n.count(".") <= 1 and not n.split(".")[-1].isdigit())
    raise ValueError(
        f"from_hf does not recognise the layout of {kind}: it looked for the modules of a decoder-only causal LM "
        f"({looked}); the model has {top}. Pass the causal LM (AutoModelForCausalLM, with its lm_head), not its "
        "base model"
    )


def mask_kinds(config: Any, num_layers: int) -> list[str]:
    """Which attention mask each decoder layer takes, as the model's forward chooses it."""
    types = getattr(config, "layer_types", None)
    if types is None:
        sliding = getattr(config, "sliding_window", None) is not None
        types = ["sliding_attention" if sliding else "full_attention"] * num_layers
    types = list(types)[:num_layers]
    odd = sorted(set(types) - set(MASK_KINDS))
    if odd or len(types) != num_layers:
        raise ValueError(
            f"from_hf builds the masks {list(MASK_KINDS)}; config.layer_types asks for {odd or types} "
            f"for {num_layers} layers"
        )
    return types


class HFStage(nn.Module):
    """A contiguous piece of a causal LM: maybe the embedding, decoder layers ``layer_ids``, maybe norm and head.

    Takes ``input_ids`` (a tensor, a tuple ``(input_ids, attention_mask[, position_ids])`` or a dict of
    those names) on the first stage and ``(hidden_states, attention_mask, position_ids)`` after; returns
    the same triple, or the logits on the last stage.
    """

    def __init__(self, model: nn.Module, layout: Layout, layer_ids: Sequence[int], first: bool, last: bool) -> None:
        super().__init__()
        get = model.get_submodule
        self.__dict__["config"] = model.config
        self.__dict__["llama"] = layout.rotary is not None
        self.first, self.last = first, last
        layers = get(layout.layers)
        self.names: list[tuple[str, str]] = []  # (attribute here, name in the model)
        if first:
            self._hold("embed", layout.embed, get)
            for attr, name in (("positions", layout.positions), ("drop", layout.drop)):
                if name:
                    self._hold(attr, name, get)
        if layer_ids and layout.rotary:
            self._hold("rotary", layout.rotary, get)
        self.layers = nn.ModuleList([layers[i] for i in layer_ids])
        self.names += [(f"layers.{k}", f"{layout.layers}.{i}") for k, i in enumerate(layer_ids)]
        kinds = mask_kinds(model.config, len(layers))
        self.kinds = [kinds[i] for i in layer_ids]
        if last:
            self._hold("norm", layout.norm, get)
            self._hold("head", layout.head, get)

    def _hold(self, attr: str, name: str, get: Any) -> None:
        self.add_module(attr, get(name))
        self.names.append((attr, name))

    def forward(self, *args: Any) -> Any:
        if self.first:
            hidden, mask, positions = self._embed(*args)
        else:
            hidden, mask, positions = args
        if len(self.layers):
            hidden = self._layers(hidden, mask, positions)
        if self.last:
            return self.head(self.norm(hidden))
        return hidden, mask, positions

    def _embed(self, *args: Any) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        ids, mask, positions = _inputs(args)
        hidden = self.embed(ids)
        if positions is None:
            positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        if "positions" in self._modules:
            hidden = hidden + self.positions(positions).to(hidden.device)
        if "drop" in self._modules:
            hidden = self.drop(hidden)
        if mask is not None and mask.dim() != 2:
            raise ValueError(f"from_hf takes a 2-D attention_mask (batch, seq), got shape {tuple(mask.shape)}")
        return hidden, mask, positions

    def _layers(self, hidden: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        makers = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
        masks = {
            kind: makers[kind](
                config=self.config,
                inputs_embeds=hidden,
                attention_mask=mask,
                past_key_values=None,
                position_ids=positions,
            )
            for kind in dict.fromkeys(self.kinds)
        }
        if self.llama:
            rotary = self.rotary(hidden, position_ids=positions)
            for layer, kind in zip(self.layers, self.kinds):
                hidden = layer(
                    hidden,
                    attention_mask=masks[kind],
                    position_ids=positions,
                    past_key_values=None,
                    use_cache=False,
                    position_embeddings=rotary,
                )
        else:
            for layer, kind in zip(self.layers, self.kinds):
                hidden = layer(hidden, attention_mask=masks[kind], use_cache=False, position_ids=positions)
        return hidden


def _inputs(args: tuple[Any, ...]) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``input_ids``, ``attention_mask``, ``position_ids`` from the first stage's arguments."""
    if len(args) == 1 and isinstance(args[0], dict):
        d = dict(args[0])
        unknown = sorted(set(d) - {"input_ids", "attention_mask", "position_ids"})
        if "input_ids" not in d or unknown:
            raise ValueError(
                f"from_hf inputs as a dict take input_ids (required), attention_mask and position_ids; got {sorted(d)}"
            )
        return d["input_ids"], d.get("attention_mask"), d.get("position_ids")
    if not 1 <= len(args) <= 3 or not isinstance(args[0], torch.Tensor):
        raise ValueError(
            "from_hf inputs are input_ids, or a tuple (input_ids, attention_mask[, position_ids]), or a dict of "
            f"those; got {len(args)} values"
        )
    return args[0], args[1] if len(args) > 1 else None, args[2] if len(args) > 2 else None


def from_hf(
    cls: type[Pipeline],
    model: nn.Module,
    *,
    stages: int | None = None,
    partition: PartitionSpec = "uniform",
    sample_inputs: Any = None,
    speeds: Sequence[float] | None = None,
    memory_caps: Sequence[float] | None = None,
    free_unused: bool = True,
    schedule: str | Schedule = "1f1b",
    microbatches: int | None = None,
    virtual_stages: int | None = None,
    group: Any = None,
    device: Any = None,
    **options: Any,
) -> Pipeline:
    """A :class:`~stagewise.Pipeline` of a transformers causal LM, cut among its decoder layers.

    ``stages``, ``schedule``, ``virtual_stages``: as for ``from_model``
    (``stages`` defaults to the schedule's stage count). ``partition``:
    ``"uniform"``, ``"parameters"``, ``"time"``, ``"memory"`` or layer counts
    per stage, the units being the decoder layers, the embedding counted with
    the first and the head with the last; ``"time"`` and ``"memory"`` profile
    ``sample_inputs`` (one micro-batch of inputs). ``free_unused``: move the
    other ranks' parameters of ``model`` to the meta device (as
    ``from_model``). ``loss_fn`` defaults to :func:`~stagewise.causal_lm_loss`
    with ``loss_weights=``:func:`~stagewise.count_tokens` (targets: the labels,
    ``-100`` ignored). Every other option is the Pipeline's.
    """
    layout = recognise(model)
    for bad in ("seed", "layers", "parallel", "tp_plan"):
        if options.get(bad) is not None:
            raise TypeError(f"from_hf does not take {bad}= (it trains the model's own layers, pipeline-parallel only)")
    options = {k: v for k, v in options.items() if k not in ("parallel", "tp_plan")}
    if options.get("loss_fn") is None:
        options["loss_fn"] = causal_lm_loss
        options.setdefault("loss_weights", count_tokens)
    n = len(model.get_submodule(layout.layers))
    ctx, run = frontend_context(schedule, stages, microbatches, virtual_stages, group, device, options)
    sched = ctx.schedule
    if n < sched.num_stages:
        raise ValueError(
            f"{sched.num_stages} stages need at least {sched.num_stages} decoder layers; {type(model).__name__} has "
            f"{n} ({layout.layers})"
        )
    units = [(str(i), HFStage(model, layout, [i], first=i == 0, last=i == n - 1)) for i in range(n)]
    plan = plan_layers(
        units,
        sched,
        partition,
        group=ctx.group,
        device=ctx.device,
        seed=0,
        sample_inputs=sample_inputs,
        speeds=speeds,
        memory_caps=memory_caps,
        timeout=run.timeout,
        store=run.store,
    )
    del units
    last = sched.num_stages - 1
    mine = {s: HFStage(model, layout, plan.ranges[s], first=s == 0, last=s == last) for s in ctx.local_stages}
    held = [name for st in mine.values() for _, name in st.names]
    if free_unused:
        free_unheld(model, mine.values())
    log.info(
        "stagewise: rank %d holds stages %s (decoder layers %s) of %s",
        ctx.rank,
        list(ctx.local_stages),
        [f"{plan.ranges[s].start}..{plan.ranges[s].stop - 1}" for s in ctx.local_stages],
        type(model).__name__,
    )
    parts = BuiltStages(
        modules={s: [st] for s, st in mine.items()},
        register=lambda root: _register(root, model, held),
        layer_ranges=plan.ranges,
        profile=plan.profile,
        tied=_ties(model, layout, n),
    )
    return cls._from_parts(ctx, parts, run)


def _ties(model: nn.Module, layout: Layout, n: int) -> TiedBuilder | None:
    """The embedding and the head as one tied key when they share their weight (and live in different units)."""
    embed, head = model.get_submodule(layout.embed), model.get_submodule(layout.head)
    if n < 2 or getattr(head, "weight", None) is not embed.weight:
        return None
    named: list[tuple[str, Any]] = [(str(i), nn.Identity()) for i in range(n)]
    named[0] = ("0", Tied("embed", embed))
    named[-1] = (str(n - 1), Tied("embed"))
    return TiedBuilder(named, 0)


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
