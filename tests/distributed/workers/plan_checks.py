"""Plans run: a few plans the planner picks for a tiny MLP, each trained against the one-process model (float64).

torchrun --standalone --nproc-per-node 4 tests/distributed/workers/worker.py --checks plan_checks --out DIR

The profile is synthetic (from parameter counts), so every rank plans alike
without measuring; ``chosen(world)`` is pure, so the pytest side lists the
same checks without starting processes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch.nn.functional as F

import stagewise as sw
from helpers import models as mdl
from helpers.compare import assert_grads_close
from stagewise.partition import LayerCost, LayerProfile
from stagewise.planning import search
from worker import Ctx

BATCH = 8
TIMEOUT = 60.0


def mlp_profile() -> LayerProfile:
    """helpers.models.mlp(): times from parameter counts (GELU cheap), 8-byte values, batch 1."""
    d, classes = mdl.D, mdl.CLASSES
    layers = []
    for k in range(8):
        linear = k % 2 == 0
        t = 2e-4 if linear else 2e-5
        layers.append(
            LayerCost(f"{k}", t, t, t if linear else 0.0, 2 * t, 8 * d, 8 * d, 8 * (d * d + d) * linear, 8 * d)
        )
    layers.append(LayerCost("8", 3e-5, 3e-5, 3e-5, 6e-5, 8 * d, 8 * d, 8 * 2 * d, 8 * d))
    layers.append(LayerCost("9", 1e-4, 1e-4, 1e-4, 2e-4, 8 * d, 8 * d, 8 * (d * classes + classes), 8 * classes))
    return LayerProfile(tuple(layers), "synthetic", 1, 0)


def chosen(world: int) -> dict[str, sw.Plan]:
    """The best plan, and the best with a pipeline over every rank, with sharding, and with v > 1."""
    plans = search(mlp_profile(), world, global_batch=BATCH, top=400).plans
    picks = {"best": plans[0]}
    rules: dict[str, Callable[[sw.Plan], bool]] = {
        "deepest": lambda p: p.layout.pp == world,
        "sharded": lambda p: p.layout.sharding > 1 and p.layout.pp > 1,
        "virtual": lambda p: p.virtual_stages > 1,
        "recompute": lambda p: p.recompute == "stage" and p.layout.pp > 1,
    }
    for name, rule in rules.items():
        match = [p for p in plans if rule(p)]
        if match:
            picks[name] = match[0]
    return picks


def run_plan(plan: sw.Plan, mesh: bool = False) -> Callable[[Ctx], dict[str, Any]]:
    """``mesh``: run the plan on a built mesh of its layout that another pipeline uses already (no new groups)."""

    def check(ctx: Ctx) -> dict[str, Any]:
        layers = mdl.mlp()
        options: dict[str, Any] = {"loss_fn": F.cross_entropy, "seed": 5, "timeout": TIMEOUT}
        if mesh:
            import torch.distributed.distributed_c10d as c10d

            built = sw.runtime.build_mesh(plan.layout)
            other = sw.ParallelConfig(pp=1, dp=ctx.world)
            wrong = built if plan.layout != other else sw.runtime.build_mesh(sw.ParallelConfig(pp=ctx.world))
            try:
                sw.Pipeline.from_plan(replace(plan, layout=other), layers, parallel=wrong, **options)
            except ValueError as err:
                assert "parallel=" in str(err) and other.describe() in str(err), err
            else:
                raise AssertionError("a mesh of another layout was accepted")
            groups = len(c10d._world.pg_map)
            sw.Pipeline.from_plan(plan, layers, parallel=built, **options)  # a first pipeline on it
            options["parallel"] = built
        pipe = sw.Pipeline.from_plan(plan, layers, **options)
        if mesh:
            assert len(c10d._world.pg_map) == groups, "a pipeline on a built mesh made process groups"
        ref = sw.build_model(layers, seed=5)
        x, y = mdl.mlp_data(BATCH, 11)
        loss = pipe.train_step(*pipe.local_batch(x, y))
        ref_loss = F.cross_entropy(ref(x), y)
        ref_loss.backward()
        assert abs(loss - ref_loss.item()) <= 1e-10 * (1 + abs(ref_loss.item())), (loss, ref_loss.item())
        assert_grads_close(pipe, ref, plan.describe())
        return {"plan": plan.describe(), "partition": list(plan.partition)}

    return check


def checks(world: int) -> dict[str, Callable[[Ctx], Any]]:
    plans = chosen(world)
    return {name: run_plan(plan) for name, plan in plans.items()} | {"on_mesh": run_plan(plans["sharded"], mesh=True)}
