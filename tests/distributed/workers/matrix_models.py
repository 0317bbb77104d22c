"""The rows of the combination matrix: each way in, building a pipeline of one small float64 model, and the
one-process model it must equal.

A :class:`Row` knows its model (with or without BatchNorm, tied or not), how to build the pipeline with the
options a column asks for, and how to build the one-process twin: for layer lists ``sw.build_model``, for a
built model a deep copy taken before the pipeline frees the other ranks' parts, for from_stages the stages
chained. The data: classification batches for the MLPs, token batches for the Hugging Face model.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import stagewise as sw
from helpers import models as mdl
from stagewise.runtime import column_parallel, row_parallel

D, CLASSES, BATCH = 8, 3, 8
SEED = 11


def mlp_layers(bn: bool = False, dtype: torch.dtype = torch.float64) -> list[Any]:
    """8 layers: Linear, Tanh (a BatchNorm when ``bn``), Linear, Tanh, Linear, Tanh, Linear, then the head."""
    linear = [sw.Layer(nn.Linear, D, D, dtype=dtype) for _ in range(4)]
    act = [sw.Layer(nn.BatchNorm1d, D, dtype=dtype) if bn else sw.Layer(nn.Tanh), sw.Layer(nn.Tanh), sw.Layer(nn.Tanh)]
    return [
        linear[0],
        act[0],
        linear[1],
        act[1],
        linear[2],
        act[2],
        linear[3],
        sw.Layer(nn.Linear, D, CLASSES, dtype=dtype),
    ]


def mlp_tp_plan() -> dict[str, Any]:
    """Column then row in each stage of two (layers 0-3, 4-7): boundary values stay whole."""
    return {"0": column_parallel(), "2": row_parallel(), "4": column_parallel(), "6": row_parallel()}


def tied_layers() -> list[Any]:
    """An embedding tied to the output head (GPT-2's tying), tokens in, logits out; 8 layers."""
    return [
        sw.Tied("embed", sw.Layer(nn.Embedding, mdl.VOCAB, D, dtype=torch.float64)),
        *[sw.Layer(nn.Linear, D, D, dtype=torch.float64) if k % 2 == 0 else sw.Layer(nn.Tanh) for k in range(6)],
        sw.Tied("embed", forward_fn=lambda emb, h: h @ emb.weight.T),
    ]


class TiedMLP(nn.Module):
    """The tied model as a PyTorch user writes it: ``head.weight = embed.weight`` (GPT-2's tying)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(SEED)
        self.embed = nn.Embedding(mdl.VOCAB, D, dtype=torch.float64)
        self.blocks = nn.Sequential(
            *[nn.Linear(D, D, dtype=torch.float64) if k % 2 == 0 else nn.Tanh() for k in range(6)]
        )
        self.head = nn.Linear(D, mdl.VOCAB, bias=False, dtype=torch.float64)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(ids)))


def mlp_data(step: int, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, D, generator=g, dtype=dtype), torch.randint(0, CLASSES, (BATCH,), generator=g)


def token_data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(200 + step)
    x = torch.randint(0, mdl.VOCAB, (BATCH, 5), generator=g)
    return x, torch.randint(0, mdl.VOCAB, (BATCH, 5), generator=g)


def token_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


@dataclass
class Built:
    """A pipeline, its one-process twin (None where the reference is a replay), its data and its loss."""

    pipe: Any
    ref: nn.Module | None
    data: Callable[[int], tuple[Any, Any]]
    loss_fn: Callable[[Any, Any], torch.Tensor]


def sequential(layers: list[Any], seed: int = SEED) -> nn.Sequential:
    """The layers built as one process builds them (seeded like a Pipeline), as a plain nn.Sequential."""
    return nn.Sequential(*sw.build_model(layers, seed=seed).children())


# ---- Hugging Face ----------------------------------------------------------------------------
def hf_model(tied: bool = False, layers: int = 4) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=mdl.VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16,
        tie_word_embeddings=tied,
        attention_dropout=0.0,
    )
    torch.manual_seed(SEED)
    return LlamaForCausalLM(config).to(torch.float64)


def hf_tp_plan(layers: int = 4) -> dict[str, Any]:
    plan: dict[str, Any] = {}
    for k in range(layers):
        base = f"model.layers.{k}"
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"{base}.{name}"] = column_parallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"{base}.{name}"] = row_parallel()
    return plan


def hf_data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(300 + step)
    ids = torch.randint(0, mdl.VOCAB, (BATCH, 6), generator=g)
    labels = ids.clone()
    labels[: BATCH // 2, :2] = -100  # uneven counted tokens over the micro-batches and replicas
    return ids, labels


class HFTwin(nn.Module):
    """A causal LM called as the pipeline calls it: input ids in, logits out (for the one-process twin)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, use_cache=False).logits

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True) -> Any:
        return self.model.named_parameters(prefix, recurse, remove_duplicate)


# ---- the ways in ------------------------------------------------------------------------------
def build_row(
    row: str,
    options: dict[str, Any],
    *,
    bn: bool = False,
    tied: bool = False,
    ctx: Any = None,
    dtype: torch.dtype = torch.float64,
    shift: float = 0.0,
    replica_shift: float = 0.0,
) -> Built:
    """The row's pipeline of a fresh model built with ``options``, and its one-process twin (``shift``: added to
    a built model's weights, so that two pipelines of one row start apart; ``replica_shift``: added after the
    twin was taken, so that a replica built apart must be made equal to the first one by the pipeline)."""
    opts = {"seed": SEED, "timeout": 60.0, **options} if row in ("layers", "from_plan") else dict(options)
    opts.setdefault("timeout", 60.0)
    if row == "from_hf":
        model = _shifted(hf_model(tied=tied).to(dtype), shift)
        twin = HFTwin(copy.deepcopy(model))
        _shifted(model, replica_shift)
        opts.setdefault("loss_fn", hf_loss)
        opts.setdefault("loss_weights", sw.count_tokens)
        return Built(sw.Pipeline.from_hf(model, **opts), twin, hf_data, hf_loss)
    layers = tied_layers() if tied else mlp_layers(bn=bn, dtype=dtype)
    data = token_data if tied else (lambda step: mlp_data(step, dtype))
    loss_fn = token_loss if tied else F.cross_entropy
    opts.setdefault("loss_fn", loss_fn)
    if row == "layers":
        return Built(sw.Pipeline(layers, **opts), sw.build_model(layers, seed=SEED), data, loss_fn)
    if row == "from_plan":
        plan = plan_for(options.get("parallel"), options.get("recompute"), options.get("schedule", "1f1b"))
        for key in ("parallel", "recompute", "schedule", "microbatches"):
            opts.pop(key, None)
        return Built(sw.Pipeline.from_plan(plan, layers, **opts), sw.build_model(layers, seed=SEED), data, loss_fn)
    model = _shifted(TiedMLP() if tied and row == "from_model" else sequential(layers), shift)
    twin = copy.deepcopy(model)
    _shifted(model, replica_shift)
    if row == "from_model":
        return Built(sw.Pipeline.from_model(model, **opts), twin, data, loss_fn)
    if row == "from_stages":
        stages = given_stages(model, opts, ctx)
        if tied:  # what a user would try: the tied embedding declared on the stages that use it
            stages = {s: [sw.Tied("embed", nn.Embedding(mdl.VOCAB, D)), m] for s, m in stages.items()}
        return Built(sw.Pipeline.from_stages(stages, **opts), stages_twin(twin), data, loss_fn)
    raise ValueError(row)


def _shifted(model: nn.Module, shift: float) -> nn.Module:
    if shift:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(shift)
    return model


POISON = -55  # a label marking a poisoned batch of the Hugging Face model (its token ids cannot carry a NaN)


def hf_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """transformers' causal-LM loss; NaN for a batch with a :data:`POISON` label (the matrix's NaN cells)."""
    poisoned = bool((labels == POISON).any())
    loss = sw.causal_lm_loss(logits, labels.masked_fill(labels == POISON, -100))
    return loss + float("nan") if poisoned else loss


def plan_for(parallel: Any, recompute: Any, schedule: str = "1f1b") -> sw.Plan:
    """A plan of ``parallel``'s layout (pp=4 without one) for the 8-layer MLP, 4 micro-batches."""
    from stagewise.planning import Plan

    layout = parallel if parallel is not None else sw.ParallelConfig(pp=4)
    counts = [8 // layout.pp] * layout.pp
    return Plan(
        layout=layout,
        schedule=schedule,
        virtual_stages=1,
        microbatches=4,
        microbatch_size=BATCH // (4 * layout.replicas),
        partition=tuple(counts),
        recompute=recompute,
        step_time=1.0,
        bubble=0.0,
        memory=(),
    )


def given_stages(model: nn.Sequential, options: dict[str, Any], ctx: Any) -> dict[int, nn.Module]:
    """This rank's stages of ``model`` cut evenly, as a user of from_stages cuts them (pp from the layout)."""
    parallel = options.get("parallel")
    pp = parallel.pp if parallel is not None else ctx.world
    mine = parallel_pp_rank(parallel, ctx) if parallel is not None else ctx.rank
    per = len(model) // pp
    return {mine: nn.Sequential(*list(model)[mine * per : (mine + 1) * per])}


def parallel_pp_rank(parallel: sw.ParallelConfig, ctx: Any) -> int:
    return parallel.coords(ctx.rank).pp


def stages_twin(model: nn.Sequential) -> nn.Module:
    """The one-process model with from_stages' names: stage ``s`` holds layers ``s*per ..``; names are
    ``stage{s}.{k}.weight``."""
    return _StagesTwin(model)


class _StagesTwin(nn.Module):
    def __init__(self, model: nn.Sequential) -> None:
        super().__init__()
        self.model = model
        self.per: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def renamed(self, pp: int) -> nn.Module:
        """The same tensors under from_stages' names (``stage{s}.{k}.weight``), parameters and buffers."""
        per = len(self.model) // pp
        holder = nn.Module()
        for s in range(pp):
            holder.add_module(f"stage{s}", nn.Sequential(*list(self.model)[s * per : (s + 1) * per]))
        return holder
