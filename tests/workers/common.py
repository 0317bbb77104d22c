"""What every multi-process check module shares: the context a check runs in."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass
class Ctx:
    """A check's rank and world size; ``group``: the pipeline group (None = WORLD)."""

    rank: int
    world: int
    group: Any = None


class Res(nn.Module):
    """A float64 residual block of width ``d``: ``h + tanh(W h + b)``."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d, dtype=torch.float64)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.lin(h))
