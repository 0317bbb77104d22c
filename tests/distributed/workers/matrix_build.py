"""The combination matrix's options per column, and building a cell's pipeline (``matrix_checks``)."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

import stagewise as sw
from matrix_models import Built, build_row, hf_tp_plan, mlp_tp_plan
from worker import Ctx

LR = 0.1
M = 4  # micro-batches of a synchronous step


def sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR)


def momentum(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """An optimizer with state (the offload column's: plain SGD has none to move)."""
    return torch.optim.SGD(params, lr=LR, momentum=0.9, weight_decay=0.01)


def column_options(row: str, column: str) -> dict[str, Any]:
    """The options a column asks for (the row's model decides the tensor-parallel plan)."""
    base: dict[str, Any] = {"optimizer": sgd, "microbatches": M}
    extra: dict[str, Any] = {
        "dp": {"parallel": sw.ParallelConfig(pp=2, dp=2)},
        "sharding": {"parallel": sw.ParallelConfig(pp=2, sharding=2)},
        "tp": {
            "parallel": sw.ParallelConfig(pp=2, tp=2),
            "tp_plan": hf_tp_plan() if row == "from_hf" else mlp_tp_plan(),
        },
        "recompute": {"recompute": "stage"},
        "bn_micro": {"batchnorm": "micro"},
        "bn_deferred": {"batchnorm": "deferred"},
        "nan_raise": {"nan_policy": "raise"},
        "nan_skip": {"nan_policy": "skip"},
        "autocast": {"autocast": torch.bfloat16},
        "async": {"schedule": "pipedream", "microbatches": 2},
        "measure_memory": {"measure_memory": True},
        "offload": {"offload": "optimizer", "optimizer": momentum},
        "merge": {"parallel": sw.ParallelConfig(pp=2, dp=2)} if row != "hetpipe" else {},
        "snapshot": {"snapshot": sw.Snapshots(every=1, folder=snapshot_folder(row)), "optimizer": momentum},
        "metrics": {"metrics": metrics_config(row), "progress": False},
        "progress": {"progress": 1},
        "lr_scheduler": {"lr_scheduler": warmup},
        "clip": {"clip": CLIP, "metrics": metrics_config(f"clip-{row}"), "progress": False, **CLIP_LAYOUT.get(row, {})},
    }.get(column, {})
    return {**base, **extra}


#: clip='s max norm: below every step's gradient norm in the matrix (the cells check it), so the clip acts
CLIP = 0.05
#: clip='s layouts: the hybrid axes whose norm is summed apart (dp copies, sharded pieces), with tied weights
CLIP_LAYOUT: dict[str, dict[str, Any]] = {
    "layers": {"parallel": sw.ParallelConfig(pp=2, dp=2)},
    "from_model": {"parallel": sw.ParallelConfig(pp=2, sharding=2)},
    "from_hf": {"parallel": sw.ParallelConfig(pp=2, sharding=2)},
}


def warmup(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    """lr_scheduler='s factory: a warm-up (lr x 0.5, 1, 1.5 at steps 0, 1, 2)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: 0.5 * (k + 1))


def metrics_config(name: str) -> Any:
    """metrics='s folder for one cell (alike on every rank), JSON lines only (TensorBoard's writer costs time)."""
    from stagewise.runtime import MetricsConfig

    root = os.environ.get("MATRIX_DIR", "/tmp/sw-matrix")
    return MetricsConfig(os.path.join(root, "metrics", name), tensorboard=False)


def snapshot_folder(row: str) -> str:
    """Where the snapshot column's cell of ``row`` keeps its snapshots (alike on every rank)."""
    return os.path.join(os.environ.get("MATRIX_DIR", "/tmp/sw-matrix"), "snapshots", row)


def build(row: str, column: str, ctx: Ctx, *, shift: float = 0.0, **more: Any) -> Built:
    options = {**column_options(row, column), **more}
    if row == "hetpipe":
        from matrix_hetpipe import build_hetpipe

        return build_hetpipe(column, options)
    bn = column in ("bn_micro", "bn_deferred")
    dtype = torch.float32 if column == "autocast" else torch.float64
    parallel = options.get("parallel")
    replica = 0.0  # a model built by the user on every rank may differ between replicas: not the first's
    if parallel is not None and row in ("from_model", "from_hf", "from_stages"):
        c = parallel.coords(ctx.rank)
        replica = 0.01 * (c.dp + c.sharding + c.tp)
    tied = column == "tied" or column == "clip"  # (clip=: a tied weight counts once in the norm)
    return build_row(row, options, bn=bn, tied=tied, ctx=ctx, dtype=dtype, shift=shift, replica_shift=replica)


# ---- the reference step ------------------------------------------------------------------------
