"""Checks of the pipeline's own optimizers (issue 51 item 2), run in feature_checks.py's torchrun jobs.

``optimizer=`` with ``lr_scheduler=`` (a warm-up) and ``clip=``: each step's loss and the weights after equal the
one-process model clipped, stepped and scheduled (float64); a user's optimizer over the parameters is refused. And
evaluation: ``eval_loss`` in eval mode, over replicas, and refused inputs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import stagewise as sw
from feature_models import CLASSES, D, gelu_mlp, mlp_data
from helpers.compare import assert_params_close
from worker import Check, Ctx, raises


def _sgd(params: list) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.3, momentum=0.9)


def _warmup(opt: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, (k + 1) / 3))


def owned(schedule: str) -> Check:
    def check(ctx: Ctx) -> None:
        layers, m = gelu_mlp(), 4
        pipe = sw.Pipeline(
            layers, loss_fn=F.cross_entropy, schedule=schedule, microbatches=m, group=ctx.group, timeout=60.0,
            optimizer=_sgd, lr_scheduler=_warmup, clip=0.05,
        )  # fmt: skip
        ref = sw.build_model(layers)
        ref_opt = _sgd(list(ref.parameters()))
        ref_sched = _warmup(ref_opt)
        for step in range(4):
            x, y = mlp_data(2 * m + 1, seed=step)
            loss = pipe.train_step(x, y)
            ref_loss = F.cross_entropy(ref(x), y)
            ref_loss.backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
            ref_opt.step(), ref_sched.step(), ref_opt.zero_grad()
            assert abs(loss - ref_loss.item()) <= 1e-10 * max(1.0, abs(ref_loss.item())), (step, loss, ref_loss)
        assert_params_close(pipe, ref, "after four clipped, scheduled steps")
        if list(pipe.parameters()):
            mine = torch.optim.SGD(pipe.parameters(), lr=0.1)
            raises(ValueError, "belong to a Pipeline built with optimizer=", mine.step)

    return check


def _one_cycle(opt: torch.optim.Optimizer, total: int = 3) -> Any:
    """Its ``step()`` raises from the ``total + 1``-th call on (the constructor's own is the first)."""
    return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.3, total_steps=total)


def _raised(step: Any, *args: Any) -> str | None:
    try:
        step(*args)
    except ValueError as err:
        return str(err)
    return None


def scheduler_raises(ctx: Ctx) -> None:
    """``OneCycleLR`` past its ``total_steps`` raises after its optimizer stepped: on every rank, once the step is
    done; the steps stand as in one process (weights to 1e-10), and the pipeline saves and trains on."""
    layers, m = gelu_mlp(), 4
    pipe = sw.Pipeline(
        layers, loss_fn=F.cross_entropy, microbatches=m, group=ctx.group, timeout=60.0, optimizer=_sgd,
        lr_scheduler=_one_cycle,
    )  # fmt: skip
    ref = sw.build_model(layers)
    ref_opt = _sgd(list(ref.parameters()))
    ref_sched = _one_cycle(ref_opt)
    for step in range(5):
        x, y = mlp_data(2 * m, seed=step)
        got = _raised(pipe.train_step, x, y)
        F.cross_entropy(ref(x), y).backward()
        ref_opt.step()
        want = _raised(ref_sched.step)
        ref_opt.zero_grad()
        assert (got is None) == (want is None) == (step < 3), (step, got, want)
        assert got is None or want is not None and got.startswith(want), (got, want)
    assert pipe.train_steps == 5
    assert_params_close(pipe, ref, "after five steps, two of them past the scheduler's end")
    x, y = mlp_data(2 * m, seed=9)
    assert abs(pipe.eval_loss(x, y) - F.cross_entropy(ref(x), y).item()) < 1e-10


def scheduler_raises_in_a_window(ctx: Ctx) -> None:
    """PipeDream: a window is not cut short; the scheduler's error comes on every rank once it is done and counted,
    and the pipeline trains on."""
    pipe = sw.Pipeline(
        gelu_mlp(), loss_fn=F.cross_entropy, schedule="pipedream", microbatches=2, group=ctx.group, timeout=60.0,
        optimizer=_sgd, lr_scheduler=lambda opt: _one_cycle(opt, 2),
    )  # fmt: skip
    window = pipe._engine.runner.lists.size
    assert window == 2, window  # the scheduler raises at the second window's first STEP, its second steps
    batches = [mlp_data(4, seed=k) for k in range(2 * window)]
    said = _raised(lambda: list(pipe.train_stream(batches)))
    assert said is not None and said.startswith("Tried to step 3 times"), said
    assert pipe.train_steps == 2 * window
    assert all(s.last_epoch == 4 for s in pipe.schedulers.values()), [s.last_epoch for s in pipe.schedulers.values()]
    assert _raised(lambda: list(pipe.train_stream(batches[:1]))) is not None and pipe.train_steps == 2 * window + 1


def same_batch(ctx: Ctx) -> None:
    """pp 2 x dp 2 (issue 51 item 7): every replica given the whole batch (local_batch forgotten) is refused on the
    first step, on every rank, before the schedule runs; each given its share trains on."""
    layers, config = gelu_mlp(), sw.ParallelConfig(pp=2, dp=2)
    pipe = sw.Pipeline(layers, loss_fn=F.cross_entropy, microbatches=2, parallel=config, timeout=60.0)
    x, y = mlp_data(8, seed=1)
    try:
        pipe.train_step(x, y)
    except (ValueError, sw.PipelineError) as err:  # (a rank may see another's failure on the board first)
        assert "were all given the same batch" in str(err) and "local_batch" in str(err), err
    else:
        raise AssertionError("the replicas trained the same batch without a word")
    assert pipe.last_step is not None and not pipe.last_step.events, "the schedule ran before the refusal"
    again = sw.Pipeline(layers, loss_fn=F.cross_entropy, microbatches=2, parallel=config, timeout=60.0)
    ref = sw.build_model(layers)
    loss = again.train_step(*again.local_batch(x, y))
    want = F.cross_entropy(ref(x), y).item()
    assert abs(loss - want) <= 1e-10 * max(1.0, abs(want)), (loss, want)
    # the replica a sampler over the replicas takes (DistributedSampler's rank): the share local_batch cuts here
    assert (again.replica, again.num_replicas) == (config.coords(ctx.rank).dp, 2), ctx.rank
    assert torch.equal(again.local_batch(x, y)[0], x.tensor_split(again.num_replicas)[again.replica]), ctx.rank


def eval_over_replicas(ctx: Ctx) -> None:
    """pp 2 x dp 2 (issue 51 item 5): eval_loss on uneven replica shares (9 rows: 5 and 4, from
    ``local_batch(..., uneven=True)``, which refuses them without it) is the one-process loss of the whole batch on
    every rank (each replica's mean weighted by its rows)."""
    layers, config = gelu_mlp(), sw.ParallelConfig(pp=2, dp=2)
    pipe = sw.Pipeline(layers, loss_fn=F.cross_entropy, microbatches=2, parallel=config, timeout=60.0, seed=2)
    ref = sw.build_model(layers, seed=2)
    x, y = mlp_data(9, seed=4)
    raises(ValueError, "uneven=True", lambda: pipe.local_batch(x, y))
    mine = pipe.local_batch(x, y, uneven=True)
    assert len(mine[0]) == len(mine[1]) == (5 if pipe.process_rank in (0, 2) else 4), (pipe.process_rank, len(mine[0]))
    loss = pipe.eval_loss(*mine)
    with torch.no_grad():
        want = F.cross_entropy(ref(x), y).item()
    assert abs(loss - want) <= 1e-12 * max(1.0, abs(want)), (loss, want)


def eval_loss(ctx: Ctx) -> None:
    """eval_loss after a train step (the training guide's block, at 2 ranks): under ``pipe.eval()`` every rank gets
    the one-process model's loss in eval mode (its dropout off); ``pipe.train()`` turns it back on."""
    layers = [
        sw.Layer(nn.Linear, D, D, dtype=torch.float64),
        sw.Layer(nn.Tanh),
        sw.Layer(nn.Dropout, 0.5),
        sw.Layer(nn.Linear, D, CLASSES, dtype=torch.float64),
    ]
    pipe = sw.Pipeline(layers, loss_fn=F.cross_entropy, microbatches=2, group=ctx.group, timeout=60.0, seed=3)
    ref = sw.build_model(layers, seed=3).eval()
    x, y = mlp_data(8, seed=5)
    pipe.train_step(x, y)  # no optimizer: the weights stay the reference's
    pipe.eval()
    loss = pipe.eval_loss(x, y)
    with torch.no_grad():
        want = F.cross_entropy(ref(x), y).item()
    assert abs(loss - want) <= 1e-12 * max(1.0, abs(want)), (loss, want)
    pipe.train()
    assert all(m.training for m in pipe.modules()), "pipe.train() left a module in eval mode"


def eval_structure(ctx: Ctx) -> None:
    """An eval whose inputs differ from training's is refused on the rank holding stage 0 (a ValueError naming
    both), before the schedule sends anything; the others raise a ValueError saying that rank refused them, and the
    pipeline evaluates on (:mod:`stagewise.runtime.engine.eval_inputs`)."""
    layers = gelu_mlp()
    pipe = sw.Pipeline(layers, loss_fn=F.cross_entropy, microbatches=2, group=ctx.group, timeout=60.0)
    x, y = mlp_data(6, seed=0)
    pipe.train_step(x, y)
    first = pipe.schedule.placement[0]
    words = ["eval_step: the inputs differ from training's", "float32"]
    theirs = ["which holds stage 0, refused the inputs: ", *words]  # (its words, carried to every rank)
    raises(ValueError, words if pipe.rank == first else theirs, lambda: pipe.eval_step(x.float()))
    assert pipe.last_step is not None and pipe.last_step.mode == "train", "the eval ran before the refusal"
    pipe.eval_loss(x, y)  # still usable


def checks(world: int) -> dict[str, Check]:
    names = ("1f1b", "zb-v", "interleaved-1f1b") if world == 2 else ("zb-v",)
    out = {f"owned-{s}": owned(s) for s in names}
    if world == 2:
        out["eval-loss"] = eval_loss
        out["eval-structure"] = eval_structure
        out["scheduler-raises"] = scheduler_raises
        out["scheduler-raises-in-a-window"] = scheduler_raises_in_a_window
    if world == 4:
        out["replicas-same-batch"] = same_batch
        out["eval-over-replicas"] = eval_over_replicas
    return out
