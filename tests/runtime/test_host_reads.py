"""The steady state reads the device once per step (the loss), never per micro-batch.

A read of a tensor's value on the host (``.item()``, ``.tolist()``, ``float(t)``, ``int(t)``, ``bool(t)``,
``.numpy()``, ``.cpu()``) stops the host until a GPU has caught up. On a CPU nothing waits, but the reads are the
same calls: they are counted here, wherever stagewise's own code makes them, over steady-state steps of a
one-process pipeline with several stages on its one rank (tensor counts from ``loss_weights`` included).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from torch import nn

import stagewise as sw
from helpers import models as mdl
from stagewise.runtime import counted_reads


def sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def count_on_device(labels: torch.Tensor) -> torch.Tensor:
    """``sw.count_tokens`` without its ``int()``: the count stays a tensor where the labels are."""
    return (labels[:, 1:] != -100).sum()


def _reads_per_step(nan_policy: str | None, loss_weights: Any, steps: int = 3, **options: Any) -> Counter[str]:
    pipe = sw.Pipeline(mdl.lm(blocks=4), loss_fn=mdl.lm_loss, schedule="interleaved-1f1b", virtual_stages=3,
                       microbatches=4, optimizer=sgd, nan_policy=nan_policy, loss_weights=loss_weights, seed=1,
                       **options)  # fmt: skip
    assert len(pipe.local_stages) == 3
    for k in range(2):  # warm: shapes learned, optimizer state made
        pipe.train_step(*mdl.lm_data(8, seed=k))
    with counted_reads() as sites:
        for k in range(steps):
            pipe.train_step(*mdl.lm_data(8, seed=10 + k))
    return sites


@pytest.mark.parametrize("loss_weights", [None, count_on_device], ids=["rows", "tensor-counts"])
def test_one_read_per_step_the_loss(one_rank, loss_weights: Any) -> None:
    sites = _reads_per_step(None, loss_weights)
    assert sum(sites.values()) == 3, f"expected one read per step (the loss), got {dict(sites)}"
    (site,) = sites
    assert site.startswith("stagewise.runtime.engine.runner:"), site


def test_the_non_finite_check_adds_its_one_read(one_rank) -> None:
    """nan_policy="raise" decides on the host whether the optimizers may step: one read more per step, no more."""
    sites = _reads_per_step("raise", count_on_device)
    assert sum(sites.values()) == 6, f"expected two reads per step (the check, the loss), got {dict(sites)}"


def test_offload_reads_nothing_more(one_rank) -> None:
    """The host update waits for the gradients (a GPU wait per stage STEP), but reads no tensor value."""
    sites = _reads_per_step(None, count_on_device, offload="optimizer")
    assert sum(sites.values()) == 3, dict(sites)


def test_bad_counts_kept_on_the_device_are_refused_at_the_read(one_rank) -> None:
    """A mini-batch with nothing to count: refused when the step's loss is read, naming it, as before."""
    pipe = sw.Pipeline(mdl.lm(blocks=2), loss_fn=mdl.lm_loss, schedule="gpipe", microbatches=2, nan_policy=None,
                       loss_weights=count_on_device)  # fmt: skip
    x, y = mdl.lm_data(4, seed=0)
    with pytest.raises(ValueError, match="loss_weights counted nothing to average over in mini-batch 0"):
        pipe.train_step(x, torch.full_like(y, -100))
    with pytest.raises(ValueError, match="loss_weights returned -3.0 for micro-batch 0: expected a count >= 0"):
        sw.Pipeline(mdl.lm(blocks=2), loss_fn=mdl.lm_loss, schedule="gpipe", microbatches=2, nan_policy=None,
                    loss_weights=lambda y: torch.tensor(-3.0)).train_step(x, y)  # fmt: skip
