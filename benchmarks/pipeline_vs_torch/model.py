"""What ``benchmarks.pipeline_vs_torch`` measures: the model, its configs, the schedule pairs, and stage costs.

Shared by the launcher (which feeds the stage costs to the simulator) and by
the torchrun workers (which time whole training steps with each library and,
between them, each stage's compute alone).
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

import stagewise as sw
from stagewise.runtime import torch_order


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
    "small": Config("small", 1024, 8, 64, 16, "8 x Linear(1024,1024)+ReLU, batch 64 in 16 micro-batches of 4 rows"),
    "tiny": Config("tiny", 32, 8, 16, 8, "8 x Linear(32,32)+ReLU, batch 16 in 8 micro-batches (a smoke run)"),
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


def torch_schedule(name: str, p: int, m: int) -> sw.Schedule:
    """torch's order of ``name``'s class, as its ``step()`` runs it, as a stagewise Schedule (validated)."""
    cls, _, v = SCHEDULES[name]
    return sw.from_torch(torch_order(cls, p, m, v, read="step"))


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
    """One stage's compute on one micro-batch (seconds of CPU time): forward, input-grad, weight-grad."""

    forward: float
    backward_input: float
    backward_weight: float

    @property
    def total(self) -> float:
        return self.forward + self.backward_input + self.backward_weight


class RankCompute:
    """One rank's stages, rebuilt outside either library, to time their compute alone.

    ``stages``: (blocks, is first stage, is last stage) for each stage the rank
    holds. A sample runs them as the rank does (all forwards, then the
    backwards in reverse), so the caches hold what they would in the pipeline.
    Times are this thread's CPU time: time spent descheduled on a shared
    machine is not compute. The last stage's forward includes the MSE loss.

    Two sets of backward costs come out of each sample:

    * ``costs("stagewise")``: the backward kernels stagewise runs (I:
      ``backward_input``, W: ``backward_weight``; B is I then W for these
      stages of plain linear layers), timed directly. The first stage's input
      needs no gradient (I is 0, W all of B);
    * ``costs("autograd")``: PyTorch's own backward, as
      torch.distributed.pipelining runs it (I: ``autograd.grad`` to the
      input; W: the full ``backward`` minus I).

    The ideal of ``benchmarks.pipeline_vs_torch`` uses the first (what a runtime with
    no overhead would take with stagewise's kernels; since those accumulate
    weight gradients fused, it is below the second).
    """

    def __init__(self, cfg: Config, stages: list[tuple[int, bool, bool]]) -> None:
        torch.manual_seed(0)
        self.stages = stages
        self.modules = [nn.Sequential(*[block(cfg.width) for _ in range(n)]) for n, _, _ in stages]
        self.inputs = [torch.randn(cfg.microbatch, cfg.width, requires_grad=not first) for _, first, _ in stages]
        self.target = torch.randn(cfg.microbatch, cfg.width)
        self.samples: dict[str, list[list[tuple[float, float, float]]]] = {
            "stagewise": [[] for _ in stages],
            "autograd": [[] for _ in stages],
        }

    def _forward(self, k: int) -> torch.Tensor:
        out = self.modules[k](self.inputs[k])
        return F.mse_loss(out, self.target) if self.stages[k][2] else out

    def sample(self) -> None:
        """Time a micro-batch through every stage: forward, then each kind of backward.

        Two rounds, the first untimed: in a step the rank's weights are warm
        from the previous micro-batch, and the libraries' steps just evicted them.
        """
        # internal: the ideal's stage costs are timed with the very kernels the runtime's I and W run, and no
        # public name offers them (they are the engine's, not a user's)
        from stagewise.runtime.engine.backward import backward_input, backward_weight

        n = len(self.stages)
        for _round in range(2):  # the last round's times are kept
            fwd, full, inp, sw_i, sw_w = {}, {}, {}, {}, {}
            outs = {}
            for k in range(n):
                outs[k], fwd[k] = _clock(self._forward, k)
            for k in reversed(range(n)):  # autograd: the full backward
                out = outs.pop(k)
                full[k] = _clock(out.backward, _ones(out))[1]
            for k in reversed(range(n)):  # stagewise: I, then W
                out = self._forward(k)
                leaves = [self.inputs[k]] if self.inputs[k].requires_grad else []
                (_, work), sw_i[k] = _clock(backward_input, [out], [_ones(out)], leaves)
                sw_w[k] = _clock(backward_weight, work)[1]
            for k, (_, first, _) in enumerate(self.stages):  # autograd: the input gradient alone
                inp[k] = 0.0
                if not first:
                    out = self._forward(k)
                    inp[k] = _clock(torch.autograd.grad, out, [self.inputs[k]], _ones(out))[1]
        for k in range(n):
            self.samples["stagewise"][k].append((fwd[k], sw_i[k], sw_w[k]))
            i = min(inp[k], full[k])
            self.samples["autograd"][k].append((fwd[k], i, full[k] - i))

    def costs(self, kernels: str = "stagewise") -> list[StageCost]:
        """Per stage, the medians over the samples (the first one warms up)."""
        out = []
        for samples in self.samples[kernels]:
            kept = samples[1:] or samples
            out.append(StageCost(*(statistics.median(x[j] for x in kept) for j in range(3))))
        return out


def _clock(fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
    """``fn(*args)`` and the CPU time this thread spent in it."""
    t0 = time.thread_time()
    out = fn(*args)
    return out, time.thread_time() - t0


def _ones(out: torch.Tensor) -> torch.Tensor | None:
    """The gradient that starts a stage's backward: none for a scalar loss."""
    return None if out.dim() == 0 else torch.ones_like(out)
