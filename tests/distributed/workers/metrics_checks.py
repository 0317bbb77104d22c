"""``metrics=`` on every rank of the feature job (issue 50 part 1): each rank its own series, no collective added.

Each rank writes ``rank{R}.jsonl`` (and TensorBoard files) under one folder; its losses are exactly what
``train_step`` returned, which is the one-process model's (float64); the learning rate is the one the step used;
the gradient norm is the one-process model's clip norm; samples are written where the batch is held (stage 0's
inputs, the last stage's targets); ``gather_state_dict`` merges the trained model on rank 0 under its
one-process names; ``memory_report`` counts this rank's parameters.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import stagewise as sw
from feature_models import lm_data, lm_loss, tied_lm
from helpers.compare import assert_params_close
from stagewise.runtime import gather_state_dict
from stagewise.runtime.reporting.files import read_metrics, series
from stagewise.runtime.reporting.sinks import tensorboard_installed
from worker import Check, Ctx, gather_objects

LRS = (0.5, 0.25, 0.125)
MAX_NORM = 0.05


def metrics(schedule: str) -> Check:
    def check(ctx: Ctx) -> dict[str, Any]:
        folder = Path(gather_objects(tempfile.mkdtemp(prefix="sw-metrics-") if ctx.rank == 0 else None, ctx.group)[0])
        layers = tied_lm()
        pipe = sw.Pipeline(
            layers, loss_fn=lm_loss, schedule=schedule, microbatches=4, group=ctx.group, seed=3, timeout=60.0,
            metrics=folder, progress=False,
        )  # fmt: skip
        ref = sw.build_model(layers, seed=3)
        opt, ref_opt = torch.optim.SGD(pipe.parameters(), lr=1.0), torch.optim.SGD(ref.parameters(), lr=1.0)
        pipe.metrics.watch(opt)
        losses, norms = [], []
        for step, lr in enumerate(LRS):
            for o in (opt, ref_opt):
                o.param_groups[0]["lr"] = lr
            x, y = lm_data(8, seed=step)
            losses.append(pipe.train_step(x, y))
            norms.append(pipe.clip_grad_norm_(MAX_NORM))
            ref_loss = lm_loss(ref(x), y)
            ref_loss.backward()
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM).item()
            assert abs(losses[-1] - ref_loss.item()) <= 1e-10 and abs(norms[-1] - ref_norm) <= 1e-10 * ref_norm
            opt.step(), ref_opt.step()
            opt.zero_grad(), ref_opt.zero_grad()
        pipe.metrics.close()
        me = pipe.process_rank
        records = read_metrics(folder, me)
        assert [v for _, v in series(records, "loss")] == losses, f"rank {me}: {series(records, 'loss')} vs {losses}"
        assert [v for _, v in series(records, "lr")] == list(LRS)
        assert [v for _, v in series(records, "grad_norm")] == norms
        holds = pipe.schedule.placement[0] == pipe.rank or pipe.schedule.placement[-1] == pipe.rank
        samples = series(records, "throughput/samples_per_s")
        assert len(samples) == (3 if holds else 0), f"rank {me} holds a batch: {holds}, wrote {samples}"
        assert all(v > 0 for _, v in series(records, "time/compute"))
        if tensorboard_installed():
            from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

            acc = EventAccumulator(str(folder / f"rank{me}"))
            acc.Reload()
            assert [e.step for e in acc.Scalars("loss")] == [1, 2, 3]
        params = sum(p.numel() * p.element_size() for p in {id(p): p for p in pipe.parameters()}.values())
        assert pipe.memory_report()["parameters"] == params
        merged = gather_state_dict(pipe, dst=0, group=ctx.group)
        if ctx.rank == 0:
            assert merged is not None and merged.keys() == ref.state_dict().keys()
            for name, value in merged.items():
                assert torch.allclose(value, ref.state_dict()[name], rtol=1e-10, atol=1e-12), name
        else:
            assert merged is None
        assert_params_close(pipe, ref, "after 3 steps")
        gather_objects(None, ctx.group)  # every rank has read its files
        if ctx.rank == 0:
            shutil.rmtree(folder)
        return {"lines": len(records)}

    return check


#: what a step may call on torch.distributed: counted with and without metrics=
COLLECTIVES = ("broadcast", "all_reduce", "all_gather", "all_gather_object", "gather", "reduce", "barrier")


def no_collective_added(ctx: Ctx) -> dict[str, Any]:
    """The same two steps with ``metrics=`` and the progress line, and with neither: the same torch.distributed
    calls, on every rank (each rank writes what it holds)."""
    counts = {}
    for on in (False, True):
        folder = tempfile.mkdtemp(prefix="sw-metrics-") if on else None
        pipe = sw.Pipeline(
            tied_lm(), loss_fn=lm_loss, schedule="1f1b", microbatches=4, group=ctx.group, seed=3, timeout=60.0,
            metrics=folder, progress=on, optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        )  # fmt: skip
        pipe.train_step(*lm_data(8, seed=0))  # (the first step sets up what later steps reuse)
        seen: list[str] = []
        saved = {name: getattr(dist, name) for name in COLLECTIVES}
        for name, fn in saved.items():
            setattr(dist, name, _counting(fn, name, seen))
        try:
            pipe.train_step(*lm_data(8, seed=1))
        finally:
            for name, fn in saved.items():
                setattr(dist, name, fn)
        counts[on] = seen
        pipe.metrics.close()
        if folder is not None:
            assert len(read_metrics(folder, pipe.process_rank)) == 2
            shutil.rmtree(folder)
    assert counts[True] == counts[False], f"rank {ctx.rank}: {counts}"
    return {"collectives per step": len(counts[True])}


def _counting(fn: Any, name: str, seen: list[str]) -> Any:
    def counted(*args: Any, **kwargs: Any) -> Any:
        seen.append(name)
        return fn(*args, **kwargs)

    return counted


def checks(world: int) -> dict[str, Check]:
    if world == 2:
        return {"metrics-zb-v": metrics("zb-v"), "metrics-no-collective": no_collective_added}
    return {"metrics-1f1b": metrics("1f1b")}
