"""Data parallelism: a stage's gradients averaged over the ``dp`` axis, in buckets, started at its SYNC.

Roughly: when the schedule reaches ``sSYNC`` (stage ``s`` has run its last
backward or W, so its gradients are final) the stage's gradients are packed
into flat buckets of at most ``bucket_bytes`` and an all-reduce is *started*
for each; the rank goes on draining the pipeline while the reductions run.
Before the stage's optimizer steps (its STEP action, or the end of
``train_step``) the buckets are waited for, divided by the number of replicas
and copied back. Tensor-parallel gradients (DTensors) are reduced through
their local shards: every ``tp`` rank reduces its own shard with the ranks
holding the same shard in the other replicas.

Gradients that are None at SYNC are skipped; every replica runs the same model
and schedule, so they are None on all replicas alike.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..comm import collectives, groups
from .tensor_parallel import local

#: the default bucket size, as ``DistributedDataParallel``'s
BUCKET_BYTES = 25 * 1024 * 1024

Wait = Callable[[Sequence[Any], str], None]


@dataclass
class _Bucket:
    work: Any
    flat: torch.Tensor
    grads: list[torch.Tensor]


class GradAverager:
    """Averages the gradients of each stage's parameters over ``group`` (the replicas of this rank)."""

    def __init__(
        self,
        stage_params: dict[int, Sequence[nn.Parameter]],
        group: Any,
        *,
        bucket_bytes: int = BUCKET_BYTES,
        wait: Wait | None = None,
    ) -> None:
        self.stage_params = {s: list(ps) for s, ps in stage_params.items()}
        self.group = group
        self.size = groups.group_size(group)
        self.bucket_bytes = bucket_bytes
        self._wait = wait or (lambda works, what: [w.wait() for w in works])
        self._pending: dict[int, list[_Bucket]] = {}

    @torch.no_grad()
    def start(self, stage: int) -> None:
        """Start the all-reduces of ``stage``'s gradients (call at its SYNC, on every replica)."""
        if stage not in self.stage_params or self.size == 1:
            return
        if stage in self._pending:
            raise RuntimeError(f"stage {stage}'s gradients are being reduced already: two SYNCs in one step")
        grads = [local(p.grad) for p in self.stage_params[stage] if p.grad is not None]
        buckets = []
        for part in _buckets(grads, self.bucket_bytes):
            flat = torch.cat([g.reshape(-1) for g in part])
            buckets.append(_Bucket(collectives.all_reduce_async(flat, self.group), flat, part))
        self._pending[stage] = buckets

    @torch.no_grad()
    def finish(self, stage: int | None = None) -> None:
        """Wait for ``stage``'s reductions (all stages' if None) and write the averages back into ``.grad``."""
        stages = list(self._pending) if stage is None else [stage] if stage in self._pending else []
        for s in stages:
            buckets = self._pending.pop(s)
            self._wait([b.work for b in buckets], f"the data-parallel gradient all-reduce of stage {s}")
            for b in buckets:
                b.flat.div_(self.size)
                offset = 0
                for g in b.grads:
                    g.copy_(b.flat[offset : offset + g.numel()].view_as(g))
                    offset += g.numel()


def _buckets(grads: list[torch.Tensor], limit: int) -> Iterator[list[torch.Tensor]]:
    """Consecutive runs of same-dtype, same-device gradients of at most ``limit`` bytes (a larger one alone)."""
    run: list[torch.Tensor] = []
    size = 0
    for g in grads:
        nbytes = g.numel() * g.element_size()
        if run and (size + nbytes > limit or g.dtype != run[0].dtype or g.device != run[0].device):
            yield run
            run, size = [], 0
        run.append(g)
        size += nbytes
    if run:
        yield run
