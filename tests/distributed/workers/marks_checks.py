"""Attributes a user sets on parameters survive ``sharding`` and ``tp_plan=`` (2 gloo ranks, float64).

Both replace a stage's parameters with new DTensor ones; an ``optimizer=`` factory that builds its groups from
marks set in the model's ``__init__`` (``p.no_decay = True``) then found none and put weight decay on every bias
and norm, with no word (found by a user pass: 2e-2 off the one-process model in 4 steps). Each check trains the
same marked model in one process, grouped the same way, and compares the losses and every parameter.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import stagewise as sw
from helpers.compare import assert_params_close
from worker import Check, Ctx

D, STEPS = 8, 3


class Marked(nn.Module):
    """A residual MLP block whose biases and norm are marked ``no_decay`` where the user builds it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, 2 * D, dtype=torch.float64)
        self.out = nn.Linear(2 * D, D, dtype=torch.float64)
        self.norm = nn.LayerNorm(D, dtype=torch.float64)
        for p in (self.fc.bias, self.out.bias, self.norm.weight, self.norm.bias):
            p.no_decay = True  # type: ignore[attr-defined]

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(h + self.out(torch.tanh(self.fc(h))))


def grouped(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """The factory: decay on what is not marked, none on what is (a mark nowhere is a test that cannot fail)."""
    marked = [p for p in params if getattr(p, "no_decay", False)]
    assert marked, "the factory found no marked parameter"
    rest = [p for p in params if not getattr(p, "no_decay", False)]
    groups = [{"params": rest, "weight_decay": 0.5}, {"params": marked, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=0.05)


def marks_kept(options: dict[str, Any]) -> Check:
    def check(ctx: Ctx) -> dict[str, Any]:
        layers = [sw.Layer(Marked) for _ in range(2)]
        pipe = sw.Pipeline(
            layers, loss_fn=F.mse_loss, microbatches=2, seed=3, optimizer=grouped, timeout=60.0, **options
        )
        ref = sw.build_model(layers, seed=3)
        opt = grouped(list(ref.parameters()))
        losses = []
        for step in range(STEPS):
            g = torch.Generator().manual_seed(step)
            x, y = (
                torch.randn(8, D, dtype=torch.float64, generator=g),
                torch.randn(8, D, dtype=torch.float64, generator=g),
            )
            losses.append(pipe.train_step(*pipe.local_batch(x, y)))
            want = F.mse_loss(ref(x), y)
            want.backward()
            opt.step()
            opt.zero_grad()
            assert abs(losses[-1] - want.item()) <= 1e-10 * abs(want.item()), (step, losses[-1], want.item())
        assert_params_close(pipe, ref, f"marked parameters under {options['parallel'].describe()}")
        return {"losses": losses}

    return check


def checks(world: int) -> dict[str, Check]:
    plan = {"*.fc": sw.runtime.column_parallel(), "*.out": sw.runtime.row_parallel()}
    return {
        "marks-sharding": marks_kept({"parallel": sw.ParallelConfig(pp=1, sharding=world)}),
        "marks-tp": marks_kept({"parallel": sw.ParallelConfig(pp=1, tp=world), "tp_plan": plan}),
    }
