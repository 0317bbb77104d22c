"""What a training script keeps from a run: the whole model's state dict on one rank, the loss curve, the metrics.

:func:`gather_state_dict` is a collective (every rank calls it): each rank's share travels as raw bytes with a
JSON index (nothing a peer sends is unpickled, :mod:`..comm.collectives`). :func:`plot_losses` draws a PNG with
matplotlib; :func:`read_metrics` reads back the JSON lines ``metrics=`` wrote.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..checkpoint.state import canonical
from ..comm import collectives, groups
from ..hybrid.tensor_parallel import full


def gather_state_dict(module: nn.Module, dst: int = 0, group: Any = None) -> dict[str, torch.Tensor] | None:
    """Every rank's share of ``module``'s state dict (a Pipeline's: one-process names, compiled layers' without
    ``_orig_mod``, as a checkpoint holds them) merged on group rank
    ``dst``, on the host; None on the other ranks. A collective over ``group`` (default: the world); without a
    process group, ``module.state_dict()`` copied to the host.

    Under any layout each tensor comes whole and once: a DTensor (a parameter split by ``sharding`` or a
    ``tp_plan``) is gathered to its full value among its mesh's ranks, and a name several ranks hold (the
    data-parallel replicas of a stage, the ranks of one shard group) is taken from the lowest group rank holding
    it - as ``DistributedDataParallel`` keeps rank 0's buffers. Only that rank's bytes travel, to ``dst`` alone.
    Two ranks holding one name with another dtype or shape are refused, naming both."""
    mine = {  # (named as checkpoints name them: without torch.compile's _orig_mod)
        canonical(k): full(v).detach().cpu().contiguous()
        for k, v in module.state_dict().items()
        if isinstance(v, torch.Tensor)
    }
    if not groups.initialized() or groups.group_size(group) == 1:
        return {k: v.clone() for k, v in mine.items()}
    index = [[k, str(v.dtype).removeprefix("torch."), list(v.shape)] for k, v in mine.items()]
    indexes = collectives.gather_json(index, group, what="the state dict's names")
    holders = owners(indexes)
    me = groups.group_rank(group)
    sent = [mine[k] for k, _, _ in indexes[me] if holders[k] == me]
    flat = [v.reshape(-1).view(torch.uint8) for v in sent if v.numel()]
    data = torch.cat(flat) if flat else torch.zeros(0, dtype=torch.uint8)
    sizes = [sum(_nbytes(d, s) for k, d, s in names if holders[k] == r) for r, names in enumerate(indexes)]
    blobs = collectives.gather_bytes_to(data, sizes, dst, group, what="the state dict's values")
    if blobs is None:
        return None
    merged: dict[str, torch.Tensor] = {}
    for rank, (names, blob) in enumerate(zip(indexes, blobs)):
        at = 0
        for name, dtype, shape in names:
            if holders[name] != rank:
                continue
            n = _nbytes(dtype, shape)
            merged[name] = blob[at : at + n].clone().view(getattr(torch, dtype)).reshape(shape)
            at += n
    return merged


def owners(indexes: Sequence[Sequence[Sequence[Any]]]) -> dict[str, int]:
    """By name, the lowest group rank holding it; a name held with two dtypes or shapes is refused."""
    found: dict[str, int] = {}
    kinds: dict[str, tuple[str, list[int]]] = {}
    for rank, names in enumerate(indexes):
        for name, dtype, shape in names:
            if name not in found:
                found[name], kinds[name] = rank, (dtype, list(shape))
            elif kinds[name] != (dtype, list(shape)):
                first = found[name]
                raise ValueError(
                    f"gather_state_dict: rank {rank} holds {name!r} as {dtype} {list(shape)}, rank {first} as "
                    f"{kinds[name][0]} {kinds[name][1]}: one name, two tensors"
                )
    return found


def _nbytes(dtype: str, shape: Sequence[int]) -> int:
    return int(torch.Size(shape).numel()) * torch.empty((), dtype=getattr(torch, dtype)).element_size()


def read_metrics(folder: str | Path, rank: int = 0) -> list[dict[str, Any]]:
    """The records and events process ``rank`` wrote under ``folder`` (``metrics=``), in order."""
    path = Path(folder) / f"rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def series(records: Sequence[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    """``(step, value)`` of ``key`` in ``records`` (:func:`read_metrics`), the last value of each step."""
    out: dict[int, float] = {}
    for r in records:
        if key in r and "event" not in r and r[key] is not None:
            out[int(r["step"])] = float(r[key])
    return sorted(out.items())


def plot_losses(
    train: Sequence[tuple[int, float]], valid: Sequence[tuple[int, float]], path: str | Path, title: str
) -> Path:
    """Training loss per step (and a centred moving average) with validation points, as a PNG at ``path``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: PLC0415 (drawing only when asked)
    from matplotlib.figure import Figure  # noqa: PLC0415

    fig = Figure(figsize=(8, 4.5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    if train:
        steps, losses = zip(*train)
        ax.plot(steps, losses, color="#4E79A7", alpha=0.35, linewidth=0.8, label="train (per step)")
        h = max(1, len(losses) // 50)  # a centred window of 2h + 1 steps
        smooth = [statistics.fmean(losses[max(0, i - h) : i + h + 1]) for i in range(len(losses))]
        ax.plot(steps, smooth, color="#4E79A7", linewidth=1.8, label=f"train (mean of {2 * h + 1} steps)")
    if valid:
        steps, losses = zip(*valid)
        ax.plot(steps, losses, "o-", color="#E15759", linewidth=1.5, markersize=4, label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title, fontsize=11)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    return Path(path)
