"""The one-process reference of HetPipe's wave-synchronous parallel: :mod:`stagewise.asynchronous.wsp`'s
equations, replayed.

Every VW is a whole model in this process. Clock by clock, each VW pulls
W0 + (1/K)[G(c - 1 - D) + its own updates of clocks c-D .. c-1], trains its
wave (an asynchronous window by the schedule's version rule, replayed by
:mod:`.async_reference`'s replay, or N plain synchronous steps), and its update
u_v^c = W(end) - W(start) is kept; G(k) sums every VW's updates through clock
k. Because the pulled weights depend only on which clocks are in - never on
arrival order - this sequential replay is what the multi-process run computes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from stagewise.asynchronous import WaveRule
from stagewise.partition import counts_to_ranges, uniform_counts
from stagewise.runtime.frontends.layers import Chain, Layers
from stagewise.runtime.frontends.one_process import build_model
from stagewise.schedules import async_schedule, registry_minibatch, schedule_info, window_of

from .async_reference import _Replay

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass
class WSPReferenceRun:
    """Each VW's mini-batch losses, each wave's loss averaged over the VWs, and the final global model."""

    losses: list[list[float]]
    global_losses: list[float]
    model: Chain
    norms: list[list[float]] = field(default_factory=list)  # each VW's clipped norms, step by step (clip=)


def wsp_reference(
    layers: Layers,
    streams: Sequence[Sequence[Batch]],
    *,
    stages: Sequence[int],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    staleness: int = 0,
    schedule: str = "pipedream",
    microbatches: int | None = None,
    wave: int | Sequence[int] | None = None,
    seed: int = 0,
    counts: Sequence[Sequence[int]] | None = None,
    autocast: torch.dtype | None = None,
    clip: float | None = None,
    lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
) -> WSPReferenceRun:
    """Replay HetPipe on ``streams[v]`` (VW v's mini-batches) with ``stages[v]`` stages per VW, in one process.

    The options mean what :class:`~stagewise.HetPipe`'s do; ``counts[v]``: VW v's layers per stage (default
    uniform; give the HetPipe's own, ``HetPipe.stage_counts``, which its default partition chose);
    ``autocast``: each synchronous step's forward and loss run under ``torch.autocast`` in that dtype, as the
    pipelines' stages do; ``clip``: each synchronous step's gradient clipped to that 2-norm over the VW's whole model
    (torch's ``clip_grad_norm_``) before its optimizers step; ``lr_scheduler``: a scheduler per stage optimizer,
    stepped after it.
    """
    rule, k = WaveRule(staleness), len(stages)
    if len(streams) != k:
        raise ValueError(f"wsp_reference: {k} VWs but {len(streams)} streams")
    workers = [
        _Worker(layers, p, seed, loss_fn, optimizer, schedule, microbatches, _size(wave, v, p, schedule), counts, v)
        for v, p in enumerate(stages)
    ]
    for worker in workers:
        worker.autocast, worker.clip = autocast, clip
        worker.schedulers = [] if lr_scheduler is None else [lr_scheduler(o) for o in worker.replay.opts]
    chunks = _waves(streams, workers)
    w0 = workers[0].flat()
    sums: list[torch.Tensor] = []  # sum over VWs of each clock's updates
    own: list[list[torch.Tensor]] = [[] for _ in range(k)]
    losses: list[list[float]] = [[] for _ in range(k)]
    global_losses = []
    for c in range(len(chunks[0])):
        total = _summed(sums[: rule.needed_before(c) + 1], w0)
        updates, means = [], []
        for v, worker in enumerate(workers):
            worker.load(w0 + (total + _summed([own[v][c_own] for c_own in rule.own_terms(c)], w0)) / k)
            start = worker.flat()
            got = worker.wave(chunks[v][c])
            losses[v] += got
            means.append(sum(got) / len(got))
            updates.append(worker.flat() - start)
            own[v].append(updates[-1])
        sums.append(_summed(updates, w0))
        global_losses.append(sum(means) / k)
    final = build_model(layers, seed)
    _load(final, w0 + _summed(sums, w0) / k)
    return WSPReferenceRun(losses, global_losses, final, [w.norms for w in workers])


def _waves(streams: Sequence[Sequence[Batch]], workers: list[_Worker]) -> list[list[list[Batch]]]:
    """Each VW's stream cut into its waves (``worker.size`` mini-batches each); every VW makes as many."""
    chunks = [[list(s[i : i + w.size]) for i in range(0, len(s), w.size)] for s, w in zip(streams, workers)]
    if len({len(c) for c in chunks}) != 1:
        raise ValueError(f"wsp_reference: the VWs' streams make different numbers of waves: {[len(c) for c in chunks]}")
    return chunks


def _summed(terms: Sequence[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """``terms`` added one by one, in order, onto zeros like ``like``."""
    total = torch.zeros_like(like)
    for t in terms:
        total += t
    return total


def _size(wave: int | Sequence[int] | None, v: int, p: int, schedule: str) -> int:
    if isinstance(wave, Sequence):
        return wave[v]
    return wave or (1 if schedule_info(schedule).synchronous else p)


class _Worker:
    """One VW's whole model, cut into its stages, with one optimizer per stage (as its pipeline has)."""

    def __init__(
        self, layers: Layers, p: int, seed: int, loss_fn: Any, optimizer: Any, schedule: str, m: int | None,
        size: int, counts: Sequence[Sequence[int]] | None, v: int,
    ) -> None:  # fmt: skip
        self.model = build_model(layers, seed)
        children = list(self.model.named_children())
        ranges = counts_to_ranges(list(counts[v]) if counts is not None else uniform_counts(len(children), p))
        self.replay = _Replay([Chain([children[j] for j in r]) for r in ranges], optimizer, loss_fn)
        self.loss_fn, self.size = loss_fn, size
        self.sync = schedule_info(schedule).synchronous
        self.m = (m or p) if self.sync else (m or registry_minibatch(schedule, p, 1))
        self.schedule = None if self.sync else async_schedule(schedule, p, size, self.m)
        self.autocast: torch.dtype | None = None
        self.clip: float | None = None
        self.schedulers: list[Any] = []
        self.norms: list[float] = []  # the gradient norms clipped, step by step

    def flat(self) -> torch.Tensor:
        return torch.cat([q.detach().reshape(-1).to(torch.float64) for q in self.model.parameters()])

    def load(self, flat: torch.Tensor) -> None:
        _load(self.model, flat)

    def wave(self, batches: list[Batch]) -> list[float]:
        if self.schedule is not None:
            sched = self.schedule if len(batches) == self.size else window_of(self.schedule, len(batches))
            return self.replay.window(sched, batches, self.m)
        return [self._sync_step(x, y) for x, y in batches]

    def _sync_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """One synchronous step: the gradient of the batch's mean loss (micro-batches weighted by their shares)."""
        total = 0.0
        for xk, yk in zip(torch.tensor_split(x, self.m), torch.tensor_split(y, self.m)):
            with torch.autocast("cpu", dtype=self.autocast or torch.bfloat16, enabled=self.autocast is not None):
                loss = self.loss_fn(self.model(xk), yk) * (len(yk) / len(y))
            loss.backward()
            total += float(loss.detach())
        if self.clip is not None:
            self.norms.append(float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)))
        for opt in self.replay.opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        for scheduler in self.schedulers:
            scheduler.step()
        return total


def _load(model: nn.Module, flat: torch.Tensor) -> None:
    at = 0
    with torch.no_grad():
        for q in model.parameters():
            q.copy_(flat[at : at + q.numel()].view_as(q).to(q.dtype))
            at += q.numel()


__all__ = ["WSPReferenceRun", "wsp_reference"]
