"""How a row trains by default: one Pipeline per method and seed, the same mini-batches, loss and memory recorded."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

import stagewise as sw

from .costs import simulated_activation_bytes
from .methods import Method, RunContext


def _param_bytes(params: Any) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def _version_bytes(pipe: sw.Pipeline) -> int:
    """The asynchronous version store's peak snapshots on this rank, in bytes (0 for a synchronous schedule)."""
    if pipe.schedule.meta.get("versions") is None:
        return 0
    return sum(row["peak_bytes"] for row in pipe.version_report().values())


def _measured_memory(pipe: sw.Pipeline, method: Method, ctx: RunContext, schedule: sw.Schedule, act_peak: int) -> Any:
    """This rank's weights, extra weight versions (the async version store's peak snapshots) and activations."""
    gathered: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(gathered, (_param_bytes(pipe.parameters()), _version_bytes(pipe), act_peak))
    memory = {k: [g[i] for g in gathered] for i, k in enumerate(("weights", "versions", "activations"))}
    memory["activations_source"] = "measured"
    if method.family == "async":
        memory["activations"] = simulated_activation_bytes(schedule, ctx.workload.layers(), ctx.profiled)
        memory["activations_source"] = "sim"
    return memory


def train_default(method: Method, ctx: RunContext, seed: int) -> dict[str, Any]:
    """Train one method with one seed; every rank returns the same record.

    The record: ``curve`` [(samples, seconds, loss) per mini-batch], ``samples_per_s``, ``train_loss``,
    ``val_loss``, ``val_accuracy``, ``memory`` ({weights, versions, activations: bytes per rank,
    activations_source}), ``timeline`` (an ``sw.Timeline`` or None; rank 0 draws it).
    """
    args, wl = ctx.args, ctx.workload
    batches = wl.train(args.steps, args.batch, seed)
    schedule = method.build(ctx.world_size, args.microbatches, args.window)
    pipe = sw.Pipeline(
        wl.layers(),
        loss_fn=wl.loss_fn,
        schedule=schedule,
        optimizer=lambda params: torch.optim.SGD(params, lr=args.lr, momentum=0.9),
        seed=seed,
        measure_memory=method.family == "sync",
        nan_policy=None,  # a method that diverges is a result ("diverged"), not a reason to stop the comparison
    )
    curve: list[tuple[int, float, float]] = []
    act_peak = 0
    dist.barrier()
    t0 = time.perf_counter()
    if method.family == "sync":
        for k, (x, y) in enumerate(batches, start=1):
            loss = pipe.train_step(x, y)
            curve.append((k * args.batch, time.perf_counter() - t0, float(loss)))
            act_peak = max(act_peak, pipe.memory_report()["peak_bytes"])
    else:
        for k, loss in enumerate(pipe.train_stream(batches), start=1):
            curve.append((k * args.batch, time.perf_counter() - t0, float(loss)))
    elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    timeline = pipe.timeline(gather=True) if ctx.keep_timeline else None
    memory = _measured_memory(pipe, method, ctx, schedule, act_peak)
    rate = len(batches) * args.batch / elapsed.item()
    record = {"seed": seed, "samples_per_s": rate, "curve": curve, "memory": memory, "timeline": timeline}
    return {**record, **_evaluate(pipe, ctx)}


def _evaluate(pipe: sw.Pipeline, ctx: RunContext) -> dict[str, float]:
    """Loss and accuracy on the workload's evaluation sets, computed where the last stage is, given to every rank."""
    wl = ctx.workload
    reporter = pipe.schedule.placement[-1]
    results = {}
    for split, (x, y) in wl.eval_sets(ctx.args.microbatches).items():
        pipe.reset_shapes()
        logits = pipe.eval_step(x)
        if pipe.rank == reporter:
            results[f"{split}_loss"] = float(wl.loss_fn(logits, y))
            results[f"{split}_accuracy"] = wl.accuracy(logits, y)
    final: list[Any] = [results if pipe.rank == reporter else None]
    dist.broadcast_object_list(final, src=reporter)
    return final[0]  # type: ignore[no-any-return]
