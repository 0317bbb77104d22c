"""stagewise's schedules on torch's runtime, and torch's on stagewise's: float64, exact against one process.

* ``on-torch-...``: a stagewise schedule (registered or synthesized) written by ``sw.to_torch_csv`` and run by
  torch.distributed.pipelining's ``_PipelineScheduleRuntime`` (``stagewise.runtime.torch_runtime``: the file
  loaded as torchtitan loads it), on ``PipelineStage`` objects cut from the one-process model; two steps,
  losses and every local gradient compared with it.
* ``on-stagewise-...``: a torch class's order (``torch_order`` -> ``sw.from_torch``) run by ``sw.Pipeline``,
  with ``runtime_checks.parity``.

``checks(world)`` is the CI selection at 2 ranks; with ``STAGEWISE_TORCH_GRID=1`` (``make torch-grid``) the
whole grid: every registered synchronous schedule at each allowed v, m in {p, 2p}, both CSV formats, and
every torch class at both readings.
"""

from __future__ import annotations

import copy
import os
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import stagewise as sw
from helpers.compare import assert_grads_close
from runtime_checks import parity
from stagewise.runtime import torch_order, torch_runtime
from stagewise.simulation import CostModel
from worker import Check, Ctx

D, CLASSES_OUT = 8, 5
GRID = os.environ.get("STAGEWISE_TORCH_GRID") == "1"


def reference(seed: int = 0) -> nn.Sequential:
    """The one-process model: 8 x (Linear, Tanh) and a classifier head, float64; every rank builds the same."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(8):
        layers += [nn.Linear(D, D, dtype=torch.float64), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(D, CLASSES_OUT, dtype=torch.float64))


def cut(n: int, total: int) -> list[range]:
    """Uniform cut of ``total`` modules into ``n`` stages, larger first."""
    base, rest = divmod(total, n)
    starts = [s * base + min(s, rest) for s in range(n + 1)]
    return [range(starts[s], starts[s + 1]) for s in range(n)]


class Local(nn.Module):
    """This rank's stage modules, under the one-process model's parameter names (for ``assert_grads_close``)."""

    def __init__(self, stages: list[nn.Module]) -> None:
        super().__init__()
        self.parts = stages

    def named_parameters(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        for part in self.parts:
            yield from part.named_parameters()


def on_torch(make: Callable[[int], sw.Schedule], fmt: str = "compute_only") -> Check:
    """``make(world)``'s schedule run by torch's runtime: two steps equal the one-process model's."""

    def check(ctx: Ctx) -> None:
        from torch.distributed.pipelining import PipelineStage

        schedule = make(ctx.world)
        ref = reference()
        bounds = cut(schedule.num_stages, len(ref))
        mine = schedule.stages_of(ctx.rank)
        modules = {s: nn.Sequential(OrderedDict((str(k), copy.deepcopy(ref[k])) for k in bounds[s])) for s in mine}
        stages = [PipelineStage(modules[s], s, schedule.num_stages, torch.device("cpu")) for s in mine]
        runtime = torch_runtime(schedule, stages, loss_fn=F.cross_entropy, format=fmt)  # type: ignore[arg-type]
        local = Local([modules[s] for s in mine])
        m, last = schedule.num_microbatches, schedule.num_stages - 1
        for step in range(2):
            g = torch.Generator().manual_seed(100 + step)
            x = torch.randn(2 * m, D, generator=g, dtype=torch.float64)
            y = torch.randint(0, CLASSES_OUT, (2 * m,), generator=g)
            losses: list[torch.Tensor] = []
            runtime.step(*((x,) if 0 in mine else ()), target=y if last in mine else None, losses=losses)
            ref.zero_grad(set_to_none=True)
            ref_loss = F.cross_entropy(ref(x), y)
            ref_loss.backward()
            if last in mine:
                torch.testing.assert_close(torch.stack(losses).mean(), ref_loss.detach(), rtol=1e-12, atol=1e-14)
            assert assert_grads_close(local, ref, f"{schedule.name} {fmt} step {step}") > 0
            for module in modules.values():
                module.zero_grad(set_to_none=True)

    return check


def registered(name: str, m: int, v: int | None = None) -> Callable[[int], sw.Schedule]:
    return lambda p: sw.build_schedule(name, p, m, v)


def synthesized(m: int, v: int = 1) -> Callable[[int], sw.Schedule]:
    """Uneven stage costs and a latency, so the order is no registered schedule's."""

    def make(p: int) -> sw.Schedule:
        forward = tuple(1.0 + 0.5 * (s % 3) for s in range(p * v))
        costs = replace(
            CostModel.uniform(p * v, weight_activation_bytes=1 / 3),
            forward=forward,
            backward_input=tuple(1.5 * f for f in forward),
            backward_weight=tuple(0.5 * f for f in forward),
            latency=0.7,
        )
        return sw.synthesize(costs, p, m, virtual_stages=v)

    return make


def torch_class(name: str, m: int, read: str = "pipeline_order", v: int | None = None) -> Callable[[int], sw.Schedule]:
    return lambda p: sw.from_torch(torch_order(name, p, m, v, read=read))


#: torch's classes and the reading CI runs them at (1F1B's table is refused: its step() is read instead)
TORCH_CLASSES = {
    "GPipe": "pipeline_order",
    "1F1B": "step",
    "Interleaved1F1B": "pipeline_order",
    "LoopedBFS": "pipeline_order",
    "InterleavedZeroBubble": "pipeline_order",
    "ZBVZeroBubble": "step",
    "DualPipeV": "step",
}


def _vs(name: str, p: int) -> tuple[int, ...]:
    info = sw.schedule_info(name)
    return info.virtual_stages if info.virtual_stages is not None else (2, 3) if p == 2 else (2,)


def ci_checks(p: int) -> dict[str, Check]:
    m = 2 * p
    out: dict[str, Check] = {}
    for name in sw.schedule_names(synchronous=True):
        out[f"on-torch-{name}-m{m}"] = on_torch(registered(name, m))
    for name in ("1f1b", "interleaved-1f1b", "zb-v"):
        out[f"on-torch-{name}-m{m}-comms"] = on_torch(registered(name, m), "compute_comms")
    out[f"on-torch-auto-m{m + 1}"] = on_torch(synthesized(m + 1))
    out[f"on-torch-auto-v2-m{m}-comms"] = on_torch(synthesized(m, v=2), "compute_comms")
    for cls, read in TORCH_CLASSES.items():
        out[f"on-stagewise-{cls}-m{m}-{read}"] = parity("mlp", torch_class(cls, m, read), m)
    out[f"on-stagewise-Interleaved1F1B-m{m}-step"] = parity("mlp", torch_class("Interleaved1F1B", m, "step"), m)
    return out


def grid_checks(p: int) -> dict[str, Check]:
    out: dict[str, Check] = {}
    for m in (p, 2 * p):
        for name in sw.schedule_names(synchronous=True):
            for v in _vs(name, p):
                for fmt in ("compute_only", "compute_comms"):
                    out[f"on-torch-{name}-v{v}-m{m}-{fmt}"] = on_torch(registered(name, m, v), fmt)
        for v in (1, 2):
            for fmt in ("compute_only", "compute_comms"):
                out[f"on-torch-auto-v{v}-m{m + 1}-{fmt}"] = on_torch(synthesized(m + 1, v), fmt)
        for cls in TORCH_CLASSES:
            for read in ("pipeline_order", "step"):
                if (cls, read) == ("1F1B", "pipeline_order") or (cls == "DualPipeV" and m < 2 * p):
                    continue  # refused: by the validator (tests/runtime), by torch's constructor
                looped = cls in ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")
                for v in (2, 3) if looped and p == 2 else (None,):  # helpers.models.mlp has 10 layers
                    out[f"on-stagewise-{cls}-v{v}-m{m}-{read}"] = parity("mlp", torch_class(cls, m, read, v), m)
    return out


def checks(world: int) -> dict[str, Check]:
    return grid_checks(world) if GRID else ci_checks(world)
