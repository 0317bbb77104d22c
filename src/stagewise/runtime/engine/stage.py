"""A stage as the engine runs it: its layers, applied in order, with autocast, recompute and aux losses."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn

from ..features.aux_loss import attach, collect_aux_losses
from ..features.recompute import Recompute, run_layers


class Stage:
    """The layers of one stage, applied in order under the calling convention (checkpointed if ``recompute``).

    While training, the :func:`~stagewise.aux_loss` terms its layers add are
    summed, scaled by ``aux_scale`` and carried on its outputs (:mod:`.aux`);
    their detached values accumulate into ``aux_totals``.
    """

    def __init__(
        self,
        index: int,
        modules: list[nn.Module],
        recompute: Recompute = None,
        precision: Callable[[], AbstractContextManager[Any]] = nullcontext,
        aux_scale: float = 1.0,
    ) -> None:
        self.index = index
        self.precision = precision  # a context factory: autocast, or nothing (see .precision)
        self.modules = modules
        self.recompute = recompute
        self.aux_scale = aux_scale
        self.aux_totals: dict[str, Any] = {}  # name -> a 0-dim tensor (read once per step by the runner)

    def __call__(self, x: Any) -> Any:
        with self.precision():
            return self._run(x)

    def _run(self, x: Any) -> Any:
        if not torch.is_grad_enabled():
            return run_layers(self.modules, x, None)
        with collect_aux_losses() as terms:
            out = run_layers(self.modules, x, self.recompute)
        if not terms:
            return out
        for name, value in terms:  # kept on the device: read once, at the step's end (Runner._aux)
            self.aux_totals[name] = self.aux_totals.get(name, 0.0) + value.detach() * self.aux_scale
        total = torch.stack([v for _, v in terms]).sum() * self.aux_scale
        return attach(out, total, self.index)
