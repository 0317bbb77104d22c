"""How a pipeline trains, whatever built its stages: the options every constructor shares."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .comm.transport.choose import TransportChoice, check_choice
from .engine.microbatch import Dims
from .features.batchnorm import BatchNormPolicy, check_batchnorm
from .features.finite import check_policy
from .features.precision import check_autocast
from .features.recompute import Recompute, check_recompute

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
LossFn = Callable[[Any, Any], torch.Tensor]
LossWeights = Callable[[Any], Any]  # one micro-batch's targets -> how many items its mean loss is over


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
    transport: TransportChoice = None
    batchnorm: str | BatchNormPolicy | None = None
    loss_weights: LossWeights | None = None
    nan_policy: str | None = "raise"
    emulate_slowdown: float | Sequence[float] | None = None

    def __post_init__(self) -> None:
        check_policy(self.nan_policy)
        check_batchnorm(self.batchnorm)
        if self.loss_weights is not None and not callable(self.loss_weights):
            raise TypeError(f"loss_weights must be a function of a micro-batch's targets, got {self.loss_weights!r}")
        check_recompute(self.recompute)
        check_autocast(self.autocast)
        check_choice(self.transport)
        _check_slowdown(self.emulate_slowdown)
        if not self.timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {self.timeout!r}")

    @property
    def step_placement(self) -> str | None:
        """Where the schedule's STEP actions go: none without an optimizer factory; at the end of each rank's
        list when the step-end check of non-finite values must come first (its collective runs at the first
        STEP); else right after each stage's SYNC, overlapping the drain."""
        if self.optimizer is None:
            return None
        return "at_end" if self.nan_policy is not None else "after_sync"

    def slowdown_of(self, rank: int, num_ranks: int) -> float:
        """EMULATION of a slower device: the factor group rank ``rank`` stretches each compute action by."""
        f = self.emulate_slowdown
        if f is None:
            return 1.0
        if isinstance(f, (int, float)):
            return float(f)
        if len(f) != num_ranks:
            raise ValueError(f"emulate_slowdown needs one factor per rank of the group ({num_ranks}), got {len(f)}")
        return float(f[rank])


def _check_slowdown(f: float | Sequence[float] | None) -> None:
    """``emulate_slowdown``: factors >= 1 (sleeping can make a rank slower, never faster)."""
    if f is None:
        return
    values = [f] if isinstance(f, (int, float)) else list(f)
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 1.0:
            raise ValueError(f"emulate_slowdown factors must be numbers >= 1 (1: full speed), got {f!r}")
