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

from ..comm import collectives, groups


def gather_state_dict(module: nn.Module, dst: int = 0, group: Any = None) -> dict[str, torch.Tensor] | None:
    """Every rank's share of ``module``'s state dict (a Pipeline's: one-process names) merged on group rank
    ``dst``, on the host; None on the other ranks. A collective over ``group`` (default: the world); without a
    process group, ``module.state_dict()`` copied to the host."""
    mine = {k: v.detach().cpu().contiguous() for k, v in module.state_dict().items() if isinstance(v, torch.Tensor)}
    if not groups.initialized() or groups.group_size(group) == 1:
        return {k: v.clone() for k, v in mine.items()}
    index = [[k, str(v.dtype).removeprefix("torch."), list(v.shape)] for k, v in mine.items()]
    indexes = collectives.gather_json(index, group, what="the state dict's names")
    flat = [v.reshape(-1).view(torch.uint8) if v.numel() else torch.zeros(0, dtype=torch.uint8) for v in mine.values()]
    data = torch.cat(flat) if flat else torch.zeros(0, dtype=torch.uint8)
    blobs = collectives.gather_bytes(data, group, what="the state dict's values")
    if groups.group_rank(group) != dst:
        return None
    merged: dict[str, torch.Tensor] = {}
    for rank, (names, blob) in enumerate(zip(indexes, blobs)):
        at = 0
        for name, dtype, shape in names:
            if name in merged:
                raise ValueError(f"gather_state_dict: rank {rank} holds {name!r}, which another rank holds too")
            kind = getattr(torch, dtype)
            n = int(torch.Size(shape).numel()) * torch.empty((), dtype=kind).element_size()
            merged[name] = blob[at : at + n].clone().view(kind).reshape(shape)
            at += n
    return merged


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
