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
from stagewise.planning import Link, search
from worker import Ctx, gather_objects, raises

BATCH = 8
TIMEOUT = 60.0
SLOW = Link(1e-3, 1e6)  # a link slow enough that pipelines win, so the ranks' cuts matter


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


def _measured_here(rank: int) -> LayerProfile:
    """The MLP's profile as one rank might measure it: every time a little off, by a rank's own amount."""
    base = mlp_profile()
    slow = [4.0 if k == 2 * rank else 1.0 for k in range(len(base.layers))]  # enough to move the cuts
    layers = tuple(replace(x, forward=x.forward * f, backward=x.backward * f) for x, f in zip(base.layers, slow))
    return replace(base, layers=layers)


def agreed(ctx: Ctx) -> dict[str, Any]:
    """sw.plan inside a job: every rank plans on rank 0's profile and options, so every rank holds the same plans
    (each rank's own search, on its own measurements and memory, would not), and the first one runs."""
    mine = _measured_here(ctx.rank)
    options: dict[str, Any] = {"global_batch": BATCH, "top": 5, "memory": 1e9 * (1 + ctx.rank), "intra": SLOW}
    alone = [p.digest() for p in search(mine, ctx.world, **options).plans]
    plans = sw.plan(mine, ctx.world, **options)
    everyone = gather_objects(([p.digest() for p in plans], alone), None)
    assert all(got == everyone[0][0] for got, _ in everyone), [got for got, _ in everyone]
    assert len({tuple(own) for _, own in everyone}) > 1, "every rank planned alike alone: the check proves nothing"
    rank0 = search(_measured_here(0), ctx.world, intra=SLOW, global_batch=BATCH, top=5, memory=1e9)
    assert [p.digest() for p in plans] == [p.digest() for p in rank0.plans]
    assert [p.step_time for p in plans] == [p.step_time for p in rank0.plans]
    run_plan(plans[0])(ctx)
    return {"plans": [p.describe() for p in plans]}


def different_plans(ctx: Ctx) -> dict[str, Any]:
    """Ranks 0 and 2 hold one plan, ranks 1 and 3 another (of another layout): every rank refuses, naming who holds
    which, before any process group of either layout is made (it used to hang until the deadline)."""
    import torch.distributed.distributed_c10d as c10d

    plans = search(mlp_profile(), ctx.world, global_batch=BATCH, top=400).plans
    a = plans[0]
    b = next(p for p in plans if p.layout != a.layout)
    mine = a if ctx.rank % 2 == 0 else b
    groups = len(c10d._world.pg_map)
    message = raises(
        ValueError,
        ["the ranks hold different plans", f"ranks 0, 2: {a.describe()}", f"ranks 1, 3: {b.describe()}", a.digest()],
        lambda: sw.Pipeline.from_plan(mine, mdl.mlp(), loss_fn=F.cross_entropy, timeout=TIMEOUT),
    )
    assert len(c10d._world.pg_map) == groups, "process groups were made before the plans were compared"
    assert len(set(gather_objects(message, None))) == 1, "the ranks raised different errors"
    return {"message": message}


def checks(world: int) -> dict[str, Callable[[Ctx], Any]]:
    plans = chosen(world)
    return (
        {name: run_plan(plan) for name, plan in plans.items()}
        | {"on_mesh": run_plan(plans["sharded"], mesh=True)}
        | {"agreed": agreed, "different_plans": different_plans}
    )
