"""BatchNorm's running statistics in the one-process replays, as ``Pipeline(batchnorm=...)`` states them.

Stated independently of :mod:`stagewise.runtime.features.batchnorm` (which merges moments with Chan's update
as the micro-batches arrive): here the inputs are kept and torch's own ``F.batch_norm`` updates the buffers.

* ``"micro"``: a micro-batch's forward (its F, not a backward's recomputation) updates the statistics, as
  torch does in training mode;
* ``"deferred"``: forwards leave them alone; when a stage steps for a mini-batch, each of its layers is
  updated once with the inputs of that mini-batch's micro-batches concatenated (one BatchNorm call on them).

Every forward normalises its micro-batch with its own statistics either way.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

POLICIES = ("micro", "deferred")


class ReplayNorms:
    """The BatchNorm layers of each stage of a replay, run under ``policy``."""

    def __init__(self, stages: list[nn.Module], policy: str) -> None:
        if policy not in POLICIES:
            raise ValueError(f"batchnorm must be one of {POLICIES}, got {policy!r}")
        self.policy = policy
        self.layers = [
            [m for m in st.modules() if isinstance(m, _BatchNorm) and m.track_running_stats] for st in stages
        ]
        self.seen: dict[tuple[int, int], dict[int, list[torch.Tensor]]] = {}  # (stage, mini-batch) -> layer inputs

    @contextmanager
    def forward(self, s: int, minibatch: int) -> Iterator[None]:
        """A micro-batch's F at stage ``s``: torch updates the statistics (micro), or its inputs are kept."""
        if self.policy == "micro" or not self.layers[s]:
            yield
            return
        seen = self.seen.setdefault((s, minibatch), {})
        hooks = [
            bn.register_forward_pre_hook(lambda m, a: seen.setdefault(id(m), []).append(a[0].detach().clone()))
            for bn in self.layers[s]
        ]
        try:
            with self.quiet(s):
                yield
        finally:
            for h in hooks:
                h.remove()

    @contextmanager
    def quiet(self, s: int) -> Iterator[None]:
        """Normalise with each micro-batch's statistics, updating nothing (a recomputation, or deferred)."""
        for bn in self.layers[s]:
            bn.track_running_stats = False
        try:
            yield
        finally:
            for bn in self.layers[s]:
                bn.track_running_stats = True

    @torch.no_grad()
    def step(self, s: int, minibatch: int) -> None:
        """Stage ``s`` steps for ``minibatch``: under ``"deferred"``, one update per layer over its inputs."""
        seen = self.seen.pop((s, minibatch), {})
        for bn in self.layers[s] if self.policy == "deferred" else ():
            inputs = seen.get(id(bn))
            if not inputs:
                continue
            tracked = bn.num_batches_tracked
            assert tracked is not None  # (track_running_stats layers only)
            tracked.add_(1)
            factor = bn.momentum if bn.momentum is not None else 1.0 / float(tracked)
            F.batch_norm(torch.cat(inputs), bn.running_mean, bn.running_var, training=True, momentum=factor)
