"""What ``pipeline_vs_torch.py`` benchmarks: the model, its configs, the schedule pairs, and stage costs.

Shared by the launcher (which measures each stage's compute alone, in one
process, for the simulator) and by the torchrun workers (which time whole
training steps with each library).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Config:
    """A model of ``blocks`` x (Linear(width, width) + ReLU), trained on ``batch`` rows in ``microbatches``."""

    name: str
    width: int
    blocks: int
    batch: int
    microbatches: int
    what: str

    def __post_init__(self) -> None:
        if self.batch % self.microbatches:
            raise ValueError(f"config {self.name}: batch {self.batch} does not split into {self.microbatches}")

    @property
    def microbatch(self) -> int:
        return self.batch // self.microbatches

    @staticmethod
    def named(name: str) -> Config:
        if name not in CONFIGS:
            raise ValueError(f"unknown config {name!r}; choose from {sorted(CONFIGS)}")
        return CONFIGS[name]


CONFIGS = {
    "overhead": Config("overhead", 1024, 8, 64, 8, "8 x Linear(1024,1024)+ReLU, batch 64 in 8 micro-batches"),
    "compute": Config("compute", 2048, 8, 256, 8, "8 x Linear(2048,2048)+ReLU, batch 256 in 8 micro-batches"),
}

#: stagewise schedule name -> (torch.distributed.pipelining class, placement, stages per rank)
SCHEDULES: dict[str, tuple[str, str, int]] = {
    "gpipe": ("ScheduleGPipe", "loop", 1),
    "1f1b": ("Schedule1F1B", "loop", 1),
    "interleaved-1f1b": ("ScheduleInterleaved1F1B", "loop", 2),
    "looped-bfs": ("ScheduleLoopedBFS", "loop", 2),
    "zb-v": ("ScheduleZBVZeroBubble", "v", 2),
    "dualpipe-v": ("ScheduleDualPipeV", "v", 2),
}


def block(width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(width, width), nn.ReLU())


def stages_of_rank(placement: str, rank: int, p: int, v: int) -> list[int]:
    """The stages rank ``rank`` holds: ``s % p`` (loop) or zig-zag (V), as stagewise and torch place them."""
    if placement == "loop":
        return [rank + c * p for c in range(v)]
    return sorted(rank if c % 2 == 0 else (c + 1) * p - 1 - rank for c in range(v))


def blocks_of_stage(blocks: int, stages: int, s: int) -> range:
    """Stage ``s``'s blocks under an even split, larger stages first (stagewise's ``uniform``)."""
    base, rest = divmod(blocks, stages)
    start = s * base + min(s, rest)
    return range(start, start + base + (1 if s < rest else 0))


@dataclass(frozen=True)
class StageCost:
    """One stage's compute on one micro-batch, alone in one process (seconds): forward, input-grad, weight-grad."""

    forward: float
    backward_input: float
    backward_weight: float

    @property
    def total(self) -> float:
        return self.forward + self.backward_input + self.backward_weight


def measure_rank(cfg: Config, stages: list[tuple[int, bool, bool]], repeats: int) -> list[StageCost]:
    """Median forward, full backward and input-only backward of one rank's stages; W is taken as B - I.

    ``stages``: (blocks, is first stage, is last stage) for each stage the rank
    holds. They run as a rank runs them (all forwards, then the backwards in
    reverse), so the caches hold what they would in the pipeline, and times
    are this thread's CPU time, as time spent descheduled on a shared machine
    is not compute. The first stage's input needs no gradient (I is 0, W all
    of B); the last stage's forward includes the MSE loss.
    """
    torch.manual_seed(0)
    modules = [nn.Sequential(*[block(cfg.width) for _ in range(n)]) for n, _, _ in stages]
    inputs = [torch.randn(cfg.microbatch, cfg.width, requires_grad=not first) for _, first, _ in stages]
    y = torch.randn(cfg.microbatch, cfg.width)
    fwd: list[list[float]] = [[] for _ in stages]
    full: list[list[float]] = [[] for _ in stages]
    inp: list[list[float]] = [[] for _ in stages]

    def forward(k: int) -> torch.Tensor:
        out = modules[k](inputs[k])
        return F.mse_loss(out, y) if stages[k][2] else out

    for _ in range(repeats + 1):
        outs = {}
        for k in range(len(stages)):
            outs[k], t = _clock(forward, k)
            fwd[k].append(t)
        for k in reversed(range(len(stages))):
            out = outs.pop(k)
            full[k].append(_clock(out.backward, _ones(out))[1])
        for k, (_, first, _) in enumerate(stages):
            if not first:
                out = forward(k)
                inp[k].append(_clock(torch.autograd.grad, out, [inputs[k]], _ones(out))[1])
    costs = []
    for k in range(len(stages)):  # the first round warms up
        f, b = statistics.median(fwd[k][1:]), statistics.median(full[k][1:])
        i = min(statistics.median(inp[k][1:]), b) if inp[k] else 0.0
        costs.append(StageCost(f, i, b - i))
    return costs


def _clock(fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
    """``fn(*args)`` and the CPU time this thread spent in it."""
    t0 = time.thread_time()
    out = fn(*args)
    return out, time.thread_time() - t0


def _ones(out: torch.Tensor) -> torch.Tensor | None:
    """The gradient that starts a stage's backward: none for a scalar loss."""
    return None if out.dim() == 0 else torch.ones_like(out)
