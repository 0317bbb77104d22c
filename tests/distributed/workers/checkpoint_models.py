"""The models and the training loop of the checkpoint checks (checkpoint_checks.py): float64 LMs, plain, with
dropout, tied, tensor-parallel; AdamW; each step on its own fixed batch, so a resumed run replays the data."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import hybrid_checks as hc
import stagewise as sw
from helpers import models as mdl

BATCH = 8


def plain() -> list[sw.Layer]:
    return mdl.lm(4)


def with_dropout() -> list[sw.Layer]:
    """Dropout on one stage: a resume is bit-exact only if that rank's RNG state comes back."""
    layers = mdl.lm(4)
    return layers[:2] + [sw.Layer(nn.Dropout, 0.2)] + layers[2:]


def _head(emb: nn.Module, h: torch.Tensor) -> torch.Tensor:
    return h @ emb.weight.T


def tied() -> list[sw.Layer]:
    """Embedding tied to the output projection: at pp=2, rank 1 holds the later use only (a tied copy)."""
    return [
        sw.Tied("embed", sw.Layer(nn.Embedding, mdl.VOCAB, mdl.D, dtype=torch.float64)),
        sw.Layer(mdl.Block),
        sw.Layer(mdl.Block),
        sw.Layer(nn.LayerNorm, mdl.D, dtype=torch.float64),
        sw.Tied("embed", forward_fn=_head),
    ]


def _embed(emb: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return emb(x) * 2.0


def tied_wrapped() -> list[sw.Layer]:
    """The first use has a forward_fn too: its parameter is ``0.module.weight`` in one process."""
    embedding = sw.Layer(nn.Embedding, mdl.VOCAB, mdl.D, dtype=torch.float64)
    return [sw.Tied("embed", embedding, forward_fn=_embed), *tied()[1:]]


def _compiled(factory: Any, *args: Any, **kwargs: Any) -> nn.Module:
    # aot_eager: torch.compile's graphs and autograd, without inductor's C++ build (minutes on 2 cores)
    return torch.compile(factory(*args, **kwargs), backend="aot_eager")


def compiled() -> list[sw.Layer]:
    """``plain()`` with every layer compiled as a user compiles a block (torchtitan does it per block)."""
    return [sw.Layer(_compiled, spec.factory, *spec.args, **spec.kwargs) for spec in plain()]


MODELS = {
    "plain": plain,
    "dropout": with_dropout,
    "tied": tied,
    "tp": hc.tp_lm,
    "tied-wrapped": tied_wrapped,
    "compiled": compiled,
}
PP2_TP2 = {"parallel": sw.ParallelConfig(pp=2, tp=2), "tp_plan": hc.tp_plan()}
PP2_SHARDING2 = {"parallel": sw.ParallelConfig(pp=2, sharding=2)}
PP2_DP2 = {"parallel": sw.ParallelConfig(pp=2, dp=2)}


def adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def pipeline(model: str, schedule: str, seed: int, *, factory: bool = True, **kw: Any) -> sw.Pipeline:
    return sw.Pipeline(
        MODELS[model](),
        loss_fn=mdl.lm_loss,
        schedule=schedule,
        microbatches=4,
        seed=seed,
        optimizer=adamw if factory else None,
        timeout=60,
        **kw,
    )


def train(pipe: sw.Pipeline, start: int, steps: int, opt: Any = None, sched: Any = None) -> list[float]:
    """Steps ``start .. start+steps-1``, each on its own fixed batch; the losses."""
    losses = []
    for step in range(start, start + steps):
        x, y = mdl.lm_data(BATCH, seed=100 + step)
        losses.append(pipe.train_step(*pipe.local_batch(x, y)))
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
        if sched is not None:
            sched.step()
    return losses
