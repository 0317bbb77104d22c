"""The sync audit on 4 gloo ranks: one read of the device per step on every rank, and token counts kept on the
device weighting the replicas' losses exactly (``torchrun ... worker.py --checks host_read_checks``).

Counts come from ``loss_weights`` as tensors (``count_on_device``) or as Python numbers (``sw.count_tokens``'s
``int``); both must give the one-process model's token mean over the global batch, however unevenly the
counted tokens fall over the micro-batches and the data-parallel replicas.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import stagewise as sw
from helpers import models as mdl
from helpers.compare import assert_params_close
from stagewise.runtime import counted_reads
from worker import Check, Ctx

BATCH = 8


def sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def count_on_device(labels: torch.Tensor) -> torch.Tensor:
    """What ``mdl.lm_loss`` averages over: the labels that are not -100, counted where they are."""
    return (labels != -100).sum()


def count_on_host(labels: torch.Tensor) -> int:
    return int((labels != -100).sum())


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = mdl.lm_data(BATCH, seed=step)
    y = y.clone()
    y[: BATCH // 2 + 1, : 2 + step % 3] = -100  # more ignored in the first rows: uneven over replicas
    return x, y


def weighted_over_replicas(loss_weights: Any) -> Check:
    def check(ctx: Ctx) -> dict[str, Any]:
        layers = mdl.lm(blocks=2)
        pipe = sw.Pipeline(layers, loss_fn=mdl.lm_loss, loss_weights=loss_weights, optimizer=sgd, microbatches=2,
                           parallel=sw.ParallelConfig(pp=2, dp=2), seed=4, timeout=60.0)  # fmt: skip
        ref = sw.build_model(layers, seed=4)
        opt = sgd(list(ref.parameters()))
        losses = []
        for step in range(3):
            x, y = data(step)
            loss = pipe.train_step(*pipe.local_batch(x, y))
            opt.zero_grad()
            want = mdl.lm_loss(ref(x), y)
            want.backward()
            opt.step()
            assert abs(loss - want.item()) <= 1e-12 * abs(want.item()), (step, loss, want.item())
            assert_params_close(pipe, ref, f"step {step}")
            losses.append(loss)
        return {"losses": losses}

    return check


def reads(parallel: sw.ParallelConfig | None, want: int) -> Check:
    """Steady-state steps: ``want`` reads per step on every rank (counted where stagewise's code makes them)."""

    def check(ctx: Ctx) -> dict[str, Any]:
        pipe = sw.Pipeline(mdl.lm(blocks=6), loss_fn=mdl.lm_loss, loss_weights=count_on_device, optimizer=sgd,
                           microbatches=4, nan_policy=None, parallel=parallel, seed=4, timeout=60.0)  # fmt: skip
        for step in range(2):
            pipe.train_step(*pipe.local_batch(*data(step)))
        with counted_reads() as sites:
            for step in range(3):
                pipe.train_step(*pipe.local_batch(*data(10 + step)))
        assert sum(sites.values()) == 3 * want, f"rank {ctx.rank}: {dict(sites)}"
        return {"sites": dict(sites)}

    return check


def checks(world: int) -> dict[str, Check]:
    assert world == 4
    return {
        "counts-on-device-over-replicas": weighted_over_replicas(count_on_device),
        "counts-on-host-over-replicas": weighted_over_replicas(count_on_host),
        "one-read-per-step-pp4": reads(None, 1),
        # the mean over the replicas (hybrid.after_train) reads its own all-reduced sums: one more
        "two-reads-per-step-pp2-dp2": reads(sw.ParallelConfig(pp=2, dp=2), 2),
    }
