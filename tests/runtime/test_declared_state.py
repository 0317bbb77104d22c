"""The declared state (:class:`stagewise.runtime.checkpoint.declared.PipelineState`) of a HetPipe, in one process:
on each rank it is its virtual worker's pipeline's, read and written through; what the protocol cannot say (the
wave rule's state, saved in parts) still makes an in-place take-over refuse it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import stagewise as sw
from stagewise.runtime.checkpoint import state
from stagewise.runtime.checkpoint.declared import PipelineState, progress_of
from stagewise.runtime.relayout import generation


def _het() -> sw.HetPipe:
    layers = [sw.Layer(nn.Linear, 4, 4, dtype=torch.float64) for _ in range(3)]
    return sw.HetPipe(layers, virtual_workers=[[0]], schedule="1f1b", microbatches=2, loss_fn=F.mse_loss, seed=3,
                      optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
                      lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, 0.5))  # fmt: skip


def test_a_hetpipe_declares_its_virtual_workers_state_and_in_place_refuses_it(one_rank: object) -> None:
    het = _het()
    pipe = het.declared
    assert isinstance(het, PipelineState) and isinstance(pipe, sw.Pipeline)
    g = torch.Generator().manual_seed(7)
    data = [(torch.randn(6, 4, dtype=torch.float64, generator=g), torch.randn(6, 4, dtype=torch.float64, generator=g))
            for _ in range(2)]  # fmt: skip
    list(het.train_stream(data))
    assert progress_of(het) == progress_of(pipe) and progress_of(het).train_steps == 2
    assert state.layout_of(het, 1) == state.layout_of(pipe, 1)
    assert het.local_stages == pipe.local_stages and het.optimizers is pipe.optimizers
    assert state.scheduler_state(het) == state.scheduler_state(pipe) is not None
    het.train_steps = 7  # a restore writes through to the pipeline
    assert pipe.train_steps == 7
    with pytest.raises(generation.InPlaceRefused, match="returned a HetPipe"):
        generation._refused(het, None)
