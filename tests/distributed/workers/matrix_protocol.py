"""The one step protocol beyond single cells: options that reach every window of an asynchronous stream,
schedule="auto", and process groups of two tied pipelines in one job."""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import nn

import stagewise as sw
from helpers.compare import assert_params_close
from matrix_build import M, build, sgd
from matrix_models import SEED, Built, build_row, mlp_data, mlp_layers
from matrix_reference import _poisoned, train_compare
from oracles.async_reference import async_reference
from worker import Check, Ctx, gather_objects, raises


def async_nan_in_a_later_window(ctx: Ctx) -> dict[str, Any]:
    """pipedream with the defaults (nan_policy="raise"): a NaN input in the third window raises on every rank,
    naming the mini-batch of the stream, and the stage that found it did not step."""
    pipe = sw.Pipeline(mlp_layers(), loss_fn=F.cross_entropy, schedule="pipedream", microbatches=2, optimizer=sgd,
                       seed=SEED, timeout=60.0)  # fmt: skip
    size = pipe.schedule.meta["versions"].minibatches
    data = [mlp_data(k) for k in range(3 * size)]
    bad = 2 * size + 1  # in the third window
    data[bad] = _poisoned(*data[bad])
    seen: list[float] = []

    def stream() -> None:
        for loss in pipe.train_stream(data):
            seen.append(loss)

    text = raises(sw.PipelineError, ["non-finite", f"mini-batch {bad}"], stream)
    assert len(seen) == 2 * size, f"the first two windows trained ({len(seen)} losses): {text}"
    return {"message": text.splitlines()[0]}


def async_batchnorm(policy: str, stashing: bool = True) -> Check:
    """pipedream with batchnorm=policy: the running statistics of the one-process replay of the rule, updated
    per micro-batch's F ("micro") or once per mini-batch over its micro-batches ("deferred"). ``stashing=False``:
    each backward recomputes its stage on the current weights and leaves the statistics alone (under "micro" its
    backward failed: the statistics were copied back, in place, under the recomputed graph)."""

    def check(ctx: Ctx) -> dict[str, Any]:
        layers = mlp_layers(bn=True)
        schedule = sw.schedules.async_schedule("pipedream", ctx.world, 3, 2, stashing=stashing)  # windows of 3 of 2
        pipe = sw.Pipeline(layers, loss_fn=F.cross_entropy, schedule=schedule, optimizer=sgd, batchnorm=policy,
                           seed=SEED, timeout=60.0)  # fmt: skip
        data = [mlp_data(k) for k in range(6)]
        losses = list(pipe.train_stream(data))
        counts = [len(r) for r in pipe.layer_ranges]  # the replay cuts as the pipeline's default partition did
        ref = async_reference(
            layers, pipe.schedule, sgd, data, loss_fn=F.cross_entropy, seed=SEED, batchnorm=policy, counts=counts
        )
        assert max(abs(a - r) for a, r in zip(losses, ref.losses)) <= 1e-10, (losses, ref.losses)
        assert_params_close(pipe, ref.model, f"pipedream, batchnorm={policy!r}", buffers=True)
        tracked = [int(t) for n, t in pipe.named_buffers() if n.endswith("num_batches_tracked")]
        assert tracked in ([], [6 if policy == "deferred" else 12]), tracked  # 6 mini-batches of 2 micro-batches
        return {"tracked": tracked}

    return check


def auto_schedule(ctx: Ctx) -> dict[str, Any]:
    """schedule="auto": synthesized on every rank alike for the profiled layers, exact like any schedule; refused
    without sample_inputs, and for a way in that is not a layer list."""
    layers = mlp_layers()
    raises(ValueError, "pass sample_inputs=", lambda: sw.Pipeline(layers, schedule="auto", loss_fn=F.cross_entropy))
    raises(ValueError, "schedule='auto' profiles a layer list", lambda: sw.Pipeline.from_model(
        nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh()), schedule="auto"))  # fmt: skip
    x, _ = mlp_data(0)
    b = Built(
        sw.Pipeline(
            layers,
            schedule="auto",
            sample_inputs=x[:2],
            loss_fn=F.cross_entropy,
            optimizer=sgd,
            microbatches=M,
            seed=SEED,
            timeout=60.0,
        ),  # fmt: skip
        sw.build_model(layers, seed=SEED),
        mlp_data,
        F.cross_entropy,
    )
    report = b.pipe.schedule.meta.get("synthesis")
    assert report is not None, "the schedule was not synthesized"
    mine = gather_objects(b.pipe.schedule.to_text(), None)
    assert len(set(mine)) == 1, "ranks synthesized different schedules"
    return {"losses": train_compare(b, "schedule='auto'"), "partition": [len(r) for r in b.pipe.layer_ranges]}


def tied_then_tied_on_a_mesh(ctx: Ctx) -> dict[str, Any]:
    """A tied pipeline over the world (its tied group: ranks 0 and 3), then a tied one on a pp 2 x dp 2 mesh
    in the same processes: the second's groups are made without a hang, and it trains exactly (torch's groups
    made by their members alone used to leave later ones out of step)."""
    first = build_row("layers", {"optimizer": sgd, "microbatches": M}, tied=True, ctx=ctx)
    train_compare(first, "tied, pp 4", steps=2)
    options = {"optimizer": sgd, "microbatches": M, "parallel": sw.ParallelConfig(pp=2, dp=2)}
    second = build_row("layers", options, tied=True, ctx=ctx)
    return {"losses": train_compare(second, "tied, pp 2 x dp 2")}


def tied_under_sharding(ctx: Ctx) -> dict[str, Any]:
    """Tied weights x sharding (the matrix's columns, together; issue 51): a built model tied as PyTorch ties it
    (``head.weight = embed.weight``) at pp 2 x sharding 2, and an sw.Tied layer list at pp 1 x dp 2 x sharding 2
    (its tie summed over the HSDP replicas): loss and every parameter equal the one-process model's. FSDP2
    ignores the tied parameter (the tied sync sums it) and shards the rest of its stage: a stage holding it was
    once left whole and its other gradients unreduced (wrong), and from_model's tie was sharded, then summed
    as a whole (a crash). (Pipeline.from_hf's: hf_checks ``gpt2-tied-pp-sharding`` and ``gpt2-planned``.)"""
    model = build("from_model", "tied", ctx, parallel=sw.ParallelConfig(pp=2, sharding=2))
    layers = build("layers", "tied", ctx, parallel=sw.ParallelConfig(pp=1, dp=2, sharding=2), microbatches=2)
    return {
        "from_model": train_compare(model, "head.weight = embed.weight, pp 2 x sharding 2"),
        "layers": train_compare(layers, "sw.Tied, pp 1 x dp 2 x sharding 2"),
    }


PROTOCOL: dict[str, Check] = {
    "protocol-tied-groups-twice": tied_then_tied_on_a_mesh,
    "protocol-tied-sharding": tied_under_sharding,
    "protocol-auto-schedule": auto_schedule,
    "protocol-async-nan-later-window": async_nan_in_a_later_window,
    "protocol-async-batchnorm-deferred": async_batchnorm("deferred"),
    "protocol-async-batchnorm-micro": async_batchnorm("micro"),
    "protocol-async-batchnorm-micro-recomputed": async_batchnorm("micro", stashing=False),
}
