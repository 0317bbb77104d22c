"""How a pipeline trains, whatever built its stages: the options every constructor shares."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .comm.transport import TransportFactory
from .engine.finite import check_policy
from .engine.microbatch import Dims
from .engine.precision import check_autocast
from .engine.recompute import Recompute, check_recompute

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
LossFn = Callable[[Any, Any], torch.Tensor]


@dataclass(frozen=True)
class RunOptions:
    """The training options of :class:`~stagewise.Pipeline` (see its docstring for each one's meaning)."""

    loss_fn: LossFn | None = None
    optimizer: OptimizerFactory | None = None
    batch_dim: Dims = 0
    target_batch_dim: Dims = 0
    timeout: float = 300.0
    store: Any = None
    recompute: Recompute = None
    measure_memory: bool = False
    autocast: torch.dtype | None = None
    variable_shapes: bool = False
    transport: TransportFactory | None = None
    nan_policy: str = "raise"

    def __post_init__(self) -> None:
        check_policy(self.nan_policy)
        check_recompute(self.recompute)
        check_autocast(self.autocast)
        if not self.timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {self.timeout!r}")
