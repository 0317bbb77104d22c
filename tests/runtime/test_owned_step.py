"""With ``optimizer=`` (the pipeline's own per-stage optimizers), what the user writes happens or is refused (issue 51
item 2): ``lr_scheduler=`` and ``clip=`` train as ``clip_grad_norm_; opt.step(); sched.step()`` in one process; a
user's optimizer or ``clip_grad_norm_`` over the parameters those optimizers own is refused; a resume that leaves a
saved scheduler state unused says so in its line. On a one-rank group (the multi-rank twin: feature_checks.py)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import stagewise as sw
from helpers import models as mdl


def _sgd(params: list) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.2, momentum=0.9)


def _warmup(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, (k + 1) / 3))


def _owned(schedule: str = "1f1b", **kw: object) -> sw.Pipeline:
    kw = {"lr_scheduler": _warmup, "clip": 0.05, **kw}
    return sw.Pipeline(
        mdl.mlp(), loss_fn=F.cross_entropy, schedule=schedule, microbatches=3, seed=2, optimizer=_sgd, **kw
    )


def _reference_steps(ref: torch.nn.Module, steps: range, max_norm: float | None) -> list[float]:
    opt = _sgd(list(ref.parameters()))
    sched = _warmup(opt)
    losses = []
    for step in steps:
        x, y = mdl.mlp_data(7, seed=step)
        loss = F.cross_entropy(ref(x), y)
        loss.backward()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("schedule", ["1f1b", "zb-v"])
def test_scheduler_and_clip_train_as_one_process(one_rank, schedule: str) -> None:
    pipe = _owned(schedule)
    ref = sw.build_model(mdl.mlp(), seed=2)
    want = _reference_steps(ref, range(5), 0.05)
    got = [pipe.train_step(*mdl.mlp_data(7, seed=step)) for step in range(5)]
    assert got == pytest.approx(want, rel=1e-12, abs=0.0)
    assert sorted(pipe.schedulers) == sorted(pipe.optimizers) and pipe.schedulers
    assert all(s.last_epoch == 5 for s in pipe.schedulers.values())
    ref_params = dict(ref.named_parameters())
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p, ref_params[name], rtol=1e-11, atol=1e-13)


def test_without_clip_the_trajectory_differs(one_rank) -> None:
    """The clip matters in the test above: without it the losses part (so a clip that did nothing would fail)."""
    pipe = _owned(clip=None)
    ref = sw.build_model(mdl.mlp(), seed=2)
    clipped = _reference_steps(ref, range(3), 0.05)
    got = [pipe.train_step(*mdl.mlp_data(7, seed=step)) for step in range(3)]
    assert got[2] != pytest.approx(clipped[2], rel=1e-6)


def test_a_users_optimizer_over_owned_parameters_is_refused(one_rank) -> None:
    pipe = _owned()
    mine = torch.optim.SGD(pipe.parameters(), lr=0.1)
    pipe.train_step(*mdl.mlp_data(7, seed=0))
    owned = r"SGD.step\(\): \d+ of its parameters belong to a Pipeline built with optimizer="
    with pytest.raises(ValueError, match=owned):
        mine.step()
    with pytest.raises(ValueError, match="clip_grad_norm_ after train_step does nothing with optimizer=.*clip="):
        pipe.clip_grad_norm_(1.0)
    for opt in pipe.optimizers.values():  # the pipeline's own still step (and an unrelated optimizer too)
        opt.step()
    torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1).step()


@pytest.mark.parametrize(
    ("keywords", "words"),
    [
        ({"lr_scheduler": _warmup}, "lr_scheduler= acts on the pipeline's own optimizers: it needs optimizer="),
        ({"clip": 1.0}, "clip= acts on the pipeline's own optimizers: it needs optimizer="),
        ({"clip": 0.0, "optimizer": _sgd}, "clip must be a gradient norm > 0"),
        ({"lr_scheduler": 3, "optimizer": _sgd}, "lr_scheduler must be a factory"),
    ],
)
def test_bad_values_are_refused(keywords: dict, words: str) -> None:
    with pytest.raises((ValueError, TypeError), match=words):
        sw.Options(**keywords)


def test_clip_is_refused_by_asynchronous_schedules(one_rank) -> None:
    with pytest.raises(ValueError, match="asynchronous schedule 'pipedream'.*clip= is not supported"):
        sw.Pipeline(mdl.mlp(), loss_fn=F.cross_entropy, schedule="pipedream", optimizer=_sgd, clip=1.0)
    pipe = sw.Pipeline(mdl.mlp(), loss_fn=F.cross_entropy, schedule="pipedream", optimizer=_sgd)
    list(pipe.train_stream([mdl.mlp_data(7, seed=0)]))
    with pytest.raises(ValueError, match="schedule 'pipedream'.*clip= is refused too.*clip in the optimizer= factory"):
        pipe.clip_grad_norm_(1.0)  # (it told the user to pass clip=, which the schedule refuses)


def test_a_checkpoint_keeps_the_schedulers_and_resume_says_when_they_are_dropped(one_rank, tmp_path, caplog) -> None:
    pipe = _owned()
    for step in range(3):
        pipe.train_step(*mdl.mlp_data(7, seed=step))
    sw.checkpoint.save(tmp_path, pipe, step=3)
    again = _owned()
    info = sw.checkpoint.load(tmp_path, again)
    assert info.scheduler_saved and info.scheduler_restored
    assert [s.last_epoch for s in again.schedulers.values()] == [3] * len(again.schedulers)
    assert again.train_step(*mdl.mlp_data(7, seed=3)) == pipe.train_step(*mdl.mlp_data(7, seed=3))
    info, said = _resumed(caplog, tmp_path, _owned(lr_scheduler=None))
    assert info is not None and info.scheduler_saved and not info.scheduler_restored
    assert "LR scheduler state was NOT restored" in said
    _, said = _resumed(caplog, tmp_path, _owned())
    assert "resumed step 3" in said and "NOT restored" not in said
    # no optimizer to take the saved one's state: said (it was dropped silently, info.optimizer_restored aside)
    plain = sw.Pipeline(mdl.mlp(), loss_fn=F.cross_entropy, schedule="1f1b", microbatches=3, seed=2)
    info, said = _resumed(caplog, tmp_path, plain)
    assert info is not None and info.optimizer_saved and not info.optimizer_restored
    assert "its optimizer state was NOT restored (none given): pass your optimizer to resume" in said
    info, said = _resumed(caplog, tmp_path, plain, _sgd(list(plain.parameters())))
    assert info is not None and info.optimizer_restored and "optimizer state was NOT" not in said


def _resumed(caplog: Any, root: Any, model: Any, *optimizer: Any) -> tuple[Any, str]:
    """``sw.checkpoint.resume`` into ``model`` (and ``optimizer``): its info and the warnings it logged."""
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="stagewise.runtime.checkpoint.resume"):
        info = sw.checkpoint.resume(root, model, *optimizer)
    return info, caplog.text


def test_a_step_that_needs_an_argument_is_refused_at_the_build(one_rank) -> None:
    """A plateau scheduler's metric and LBFGS's closure cannot be given at a stage's STEP: refused when the pipeline
    is built, saying what to do, where they failed the first step for good before (a user pass)."""
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau
    with pytest.raises(ValueError, match=r"ReduceLROnPlateau\.step\(\) needs metrics.*train_step with the loss"):
        _owned(lr_scheduler=plateau)
    with pytest.raises(ValueError, match=r"optimizer=: LBFGS\.step\(\) needs a closure"):
        sw.Pipeline(mdl.mlp(), loss_fn=F.cross_entropy, microbatches=3, optimizer=torch.optim.LBFGS)
    _owned(lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 2)).train_step(*mdl.mlp_data(7, seed=0))


def test_clips_norm_is_in_the_last_record_without_metrics(one_rank) -> None:
    """What ``clip_grad_norm_`` returns in one process, the norm before clipping, is ``pipe.metrics.last``'s
    ``grad_norm`` after each step, with no ``metrics=`` (it was only with one, a user pass found)."""
    pipe = _owned()
    ref = sw.build_model(mdl.mlp(), seed=2)
    opt = _sgd(list(ref.parameters()))
    sched = _warmup(opt)
    for step in range(3):
        x, y = mdl.mlp_data(7, seed=step)
        loss = pipe.train_step(x, y)
        F.cross_entropy(ref(x), y).backward()
        norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05))
        opt.step()
        sched.step()
        opt.zero_grad()
        assert pipe.metrics.last["grad_norm"] == pytest.approx(norm, rel=1e-12), step
        assert pipe.metrics.last["loss"] == loss


def test_the_resume_line_says_what_brings_a_dropped_scheduler_back() -> None:
    """A checkpoint's scheduler state goes to scheduler= or lr_scheduler=; peer snapshots hold lr_scheduler='s only."""
    from pathlib import Path

    from stagewise.runtime.checkpoint.declared import CheckpointInfo
    from stagewise.runtime.checkpoint.resume import scheduler_note

    def info(reason: str, saved: bool = True, restored: bool = False) -> CheckpointInfo:
        return CheckpointInfo(Path("c"), 3, None, {}, {}, True, restored, True, reason, scheduler_saved=saved)

    disk = scheduler_note(info("the newest checkpoint"))
    assert "pass scheduler= to resume" in disk and "lr_scheduler=" in disk
    snapshots = scheduler_note(info("peer snapshots: step 3 (generation 0), newer than any checkpoint"))
    assert "NOT restored" in snapshots and "lr_scheduler=" in snapshots and "scheduler= to resume" not in snapshots
    assert scheduler_note(info("peer snapshots: step 3", restored=True)) == scheduler_note(info("x", saved=False)) == ""


def _one_cycle(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.2, total_steps=3)


def _raised(step: Any, *args: Any) -> str | None:
    """The error ``step(*args)`` raised (its text and notes), or None."""
    try:
        step(*args)
    except ValueError as err:
        return "\n".join([str(err), *getattr(err, "__notes__", [])])
    return None


@pytest.mark.parametrize("schedule", ["1f1b", "zb-v"])
def test_a_scheduler_that_raises_leaves_the_step_taken_and_the_pipeline_whole(one_rank, tmp_path, schedule) -> None:
    """``OneCycleLR`` past its ``total_steps`` raises at its ``step()``, after the optimizer stepped: in one process
    the step stands and the loop can go on. The pipeline raises the scheduler's own error once the train step is
    done and counted, and stays whole: it trains on, evaluates and saves (a failed pipeline refused all three)."""
    pipe = _owned(schedule, lr_scheduler=_one_cycle, clip=None)
    ref = sw.build_model(mdl.mlp(), seed=2)
    opt = _sgd(list(ref.parameters()))
    sched = _one_cycle(opt)
    got, want = [], []
    for k in range(5):
        x, y = mdl.mlp_data(7, seed=k)
        got.append(_raised(pipe.train_step, x, y))
        F.cross_entropy(ref(x), y).backward()
        opt.step()
        want.append(_raised(sched.step))
        opt.zero_grad()
    assert [g is None for g in got] == [w is None for w in want] == [True] * 3 + [False] * 2
    assert all(g.startswith(w) and "the train step ran to its end" in g for g, w in zip(got[3:], want[3:]))
    assert pipe.train_steps == 5
    ref_params = dict(ref.named_parameters())
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p, ref_params[name], rtol=1e-11, atol=1e-13)
    sw.checkpoint.save(tmp_path, pipe, step=pipe.train_steps)
    x, y = mdl.mlp_data(7, seed=9)
    assert pipe.eval_loss(x, y) == pytest.approx(F.cross_entropy(ref(x), y).item(), rel=1e-12)
