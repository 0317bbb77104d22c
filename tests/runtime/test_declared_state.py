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


def _staged() -> sw.Pipeline:
    """Two local stages (interleaved, one rank) whose optimizers the factory builds with different LRs, and a
    warm-up rule stepping both in lockstep."""

    def sgd(ps: list[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(ps, lr=0.5 if ps[0].shape[1] == 4 else 0.03)  # stage 0 takes 4 features

    layers = [sw.Layer(nn.Linear, 4, 6, dtype=torch.float64), sw.Layer(nn.Linear, 6, 4, dtype=torch.float64)]
    warm = lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: s + 1)  # noqa: E731
    return sw.Pipeline(layers, loss_fn=F.mse_loss, schedule="interleaved-1f1b", virtual_stages=2, microbatches=2,
                       optimizer=sgd, lr_scheduler=warm)  # fmt: skip


def test_a_pipelines_schedule_position_restores_each_stage_at_its_own_rates(one_rank: object) -> None:
    """What a take-over or a snapshot resume carries (:func:`state.scheduler_state`) puts every stage's scheduler
    at the saved step, at its own stage's LR (stage 0's base LR in every stage was the old bug)."""
    old, new = _staged(), _staged()
    assert sorted(old.schedulers) == [0, 1]
    x, y = torch.randn(4, 4, dtype=torch.float64), torch.randn(4, 4, dtype=torch.float64)
    for _ in range(2):
        old.train_step(x, y)
    for s, opt in new.optimizers.items():  # the optimizers' LRs, by name, as the fill restores them first
        opt.param_groups[0]["lr"] = old.optimizers[s].param_groups[0]["lr"]
    state.restore_scheduler(new, state.scheduler_state(old))
    for s in (0, 1):
        assert new.schedulers[s].get_last_lr() == old.schedulers[s].get_last_lr() == [[0.5, 0.03][s] * 3], s
        old.schedulers[s].step(), new.schedulers[s].step()
        assert new.schedulers[s].get_last_lr() == old.schedulers[s].get_last_lr(), s
