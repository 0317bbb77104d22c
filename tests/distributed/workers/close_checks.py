"""``pipe.close()`` on 2 gloo ranks (float64): the process groups a build made are destroyed and the threads they
held go, so a process building pipeline after pipeline stays bounded; a closed pipeline refuses to train, by name;
the next one built trains as the first did.

Before ``close()`` existed, a dp 2 pipeline built five times in one process held 21 groups and 67 threads (4
groups and 12 threads a build, measured); the checks below fail on any growth.
"""

from __future__ import annotations

import gc
import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import stagewise as sw
from stagewise.runtime.comm import groups
from worker import Check, Ctx, raises

BUILDS = 3
TP_PLAN = {"0": sw.runtime.column_parallel(), "1": sw.runtime.row_parallel()}


def _tasks() -> int:
    """This process's threads, the C++ ones (gloo's) too."""
    return len(os.listdir("/proc/self/task"))


def _pipeline(options: dict[str, Any]) -> sw.Pipeline:
    return sw.Pipeline(
        [sw.Layer(nn.Linear, 4, 4, dtype=torch.float64) for _ in range(4)], loss_fn=F.mse_loss, schedule="1f1b",
        microbatches=2, seed=1, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), timeout=60.0, **options,
    )  # fmt: skip


def lets_go(options: dict[str, Any]) -> Check:
    """Build, train a step, close, ``BUILDS`` times: every build made groups, every close destroyed them."""

    def check(ctx: Ctx) -> dict[str, Any]:
        g = torch.Generator().manual_seed(7)
        x, y = torch.randn(8, 4, dtype=torch.float64, generator=g), torch.randn(8, 4, dtype=torch.float64, generator=g)
        base = len(groups.registered())
        losses, tasks, states = [], [], []
        for _ in range(BUILDS):
            pipe = _pipeline(options)
            made = len(groups.registered()) - base
            assert made > 0, f"the build made no process group: {options} does not test close()"
            losses.append(pipe.train_step(*pipe.local_batch(x, y)))
            states.append(sw.runtime.gather_state_dict(pipe))  # (tp, sharding: every DTensor gathered whole)
            pipe.close()
            left = len(groups.registered()) - base
            assert left == 0, f"close() left {left} of the {made} groups the build made"
            raises(sw.PipelineError, "was closed", lambda p=pipe: p.train_step(*p.local_batch(x, y)))
            pipe.close()  # a second close does nothing
            del pipe
            gc.collect()
            tasks.append(_tasks())
        assert tasks[-1] <= tasks[0], f"threads grew build after build: {tasks}"
        assert losses == [losses[0]] * BUILDS, f"a pipeline built after a closed one trained differently: {losses}"
        for state in states[1:]:  # (rank 0's; None elsewhere)
            assert state is None or all(torch.equal(v, states[0][k]) for k, v in state.items()), "another state"
        return {"tasks": tasks}

    return check


def checks(world: int) -> dict[str, Check]:
    return {
        "close-dp": lets_go({"parallel": sw.ParallelConfig(pp=1, dp=world)}),
        "close-snapshot": lets_go({"snapshot": 1}),
        # DTensor's caches handed a second build's outputs the first build's mesh, whose groups close() destroyed
        "close-tp": lets_go({"parallel": sw.ParallelConfig(pp=1, tp=world), "tp_plan": TP_PLAN}),
        "close-sharding": lets_go({"parallel": sw.ParallelConfig(pp=1, sharding=world)}),
    }
