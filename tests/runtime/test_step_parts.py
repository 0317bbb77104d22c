"""The runner's step seam and one mode for every schedule, on a one-rank process group.

A :class:`~stagewise.runtime.engine.runner.StepPart` (``around``, ``after``) plugs into every step without the
runner knowing it: a part recording what it is shown, and one copying the state after each train step (what a
peer snapshot needs), are added here as the assembly adds its own. ``train_stream`` takes every schedule (a
synchronous one streams step after step, exactly as ``train_step``), and HetPipe has ``eval_step``, ``steps=``
and the declared checkpoint protocol; every refusal of HetPipe's is in ``combinations.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import stagewise as sw
from stagewise.runtime.assembly.combinations import HETPIPE_REFUSED, refuse_hetpipe
from stagewise.runtime.checkpoint.parts import SavedInParts
from stagewise.runtime.engine.run import Run
from stagewise.runtime.options import Options

LR = 0.125


def _layers() -> list[sw.Layer]:
    return [sw.Layer(nn.Linear, 4, 4, dtype=torch.float64) for _ in range(3)]


def _sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR)


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(6, 4, dtype=torch.float64, generator=g), torch.randn(6, 4, dtype=torch.float64, generator=g))
            for _ in range(n)]  # fmt: skip


class _Recorder:
    """A step part that writes down what it is shown, and when."""

    def __init__(self) -> None:
        self.seen: list[tuple[Any, ...]] = []

    @contextmanager
    def around(self, run: Run) -> Iterator[None]:
        self.seen.append(("enter", run.mode, run.minibatches, run.per_minibatch, run.first))
        yield
        self.seen.append(("exit", run.mode, len(run.record.events) > 0))

    def after(self, run: Run) -> None:
        self.seen.append(("after", run.mode, list(run.losses)))


class _Snapshot:
    """After each train step, a copy of the state (what a peer snapshot takes): a feature the runner never names."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.copies: list[dict[str, torch.Tensor]] = []

    @contextmanager
    def around(self, run: Run) -> Iterator[None]:
        yield

    def after(self, run: Run) -> None:
        if run.mode == "train":
            self.copies.append({k: v.detach().clone() for k, v in self.module.state_dict().items()})


def test_a_step_part_plugs_in_without_the_runner_knowing_it(one_rank) -> None:
    pipe = sw.Pipeline(_layers(), loss_fn=F.mse_loss, schedule="1f1b", microbatches=2, optimizer=_sgd, seed=1)
    recorder, snapshot = _Recorder(), _Snapshot(pipe)
    pipe._engine.runner.parts += [recorder, snapshot]  # as the assembly registers its own
    (x, y), (x2, y2) = _batches(2)
    losses = [pipe.train_step(x, y), pipe.train_step(x2, y2)]
    pipe.eval_step(x)
    assert recorder.seen == [
        ("enter", "train", 1, 2, 0), ("exit", "train", True), ("after", "train", [losses[0]]),
        ("enter", "train", 1, 2, 1), ("exit", "train", True), ("after", "train", [losses[1]]),
        ("enter", "eval", 1, 2, 2), ("exit", "eval", True), ("after", "eval", []),
    ]  # fmt: skip
    assert len(snapshot.copies) == 2  # after each train step, none after the eval
    for name, value in pipe.state_dict().items():  # the copy is the state the step left (its STEPs ran)
        torch.testing.assert_close(snapshot.copies[-1][name], value, rtol=0, atol=0)
    assert not torch.equal(snapshot.copies[0]["0.weight"], snapshot.copies[1]["0.weight"])


def test_a_sync_hook_sees_each_stage_s_final_gradients(one_rank) -> None:
    """``register_sync_hook``: called at each SYNC, once the stage's gradients are final (its whole mini-batch's)."""
    pipe = sw.Pipeline(_layers(), loss_fn=F.mse_loss, schedule="gpipe", microbatches=3, seed=4)
    seen: dict[int, dict[str, torch.Tensor]] = {}
    pipe.register_sync_hook(lambda s: seen.update({s: {n: p.grad.clone() for n, p in pipe.named_parameters()}}))
    pipe.train_step(*_batches(1)[0])
    assert list(seen) == [0]
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(seen[0][name], p.grad, rtol=0, atol=0)


def test_a_failing_step_leaves_every_part_it_entered(one_rank) -> None:
    pipe = sw.Pipeline(_layers(), loss_fn=F.mse_loss, schedule="gpipe", microbatches=2, seed=1)
    recorder = _Recorder()
    pipe._engine.runner.parts.append(recorder)
    with pytest.raises(ValueError, match="needs the targets"):
        pipe.train_step(_batches(1)[0][0], None)
    assert recorder.seen == []  # refused while cutting the batch: no part entered
    pipe2 = sw.Pipeline(_layers(), loss_fn=lambda out, y: out.sum() / 0 + torch.tensor(float("nan")), seed=1,
                        schedule="gpipe", microbatches=2, nan_policy="raise")  # fmt: skip
    recorder2 = _Recorder()
    pipe2._engine.runner.parts.append(recorder2)
    with pytest.raises(sw.PipelineError, match="non-finite"):
        pipe2.train_step(*_batches(1)[0])
    assert [e[0] for e in recorder2.seen] == ["enter", "exit"]  # left; the check (an earlier part) refused


def test_the_check_as_a_step_part_puts_a_skipped_step_s_buffers_back(one_rank) -> None:
    """nan_policy="skip" plugs in as a part of every step: the buffers it found at the step's start (BatchNorm's
    running statistics, moved by the forwards of a NaN batch) are put back, and no weight moves."""
    layers = [sw.Layer(nn.Linear, 4, 4, dtype=torch.float64), sw.Layer(nn.BatchNorm1d, 4, dtype=torch.float64),
              sw.Layer(nn.Linear, 4, 4, dtype=torch.float64)]  # fmt: skip
    pipe = sw.Pipeline(layers, loss_fn=F.mse_loss, schedule="1f1b", microbatches=2, optimizer=_sgd, seed=5,
                       batchnorm="micro", nan_policy="skip")  # fmt: skip
    (x, y), (x2, y2) = _batches(2)
    pipe.train_step(x, y)
    before = {k: v.clone() for k, v in pipe.state_dict().items()}
    x2[1, 2] = float("nan")
    pipe.train_step(x2, y2)
    assert pipe.skipped_steps == 1
    for name, value in pipe.state_dict().items():
        torch.testing.assert_close(value, before[name], rtol=0, atol=0, msg=name)


def test_train_stream_takes_a_synchronous_schedule_step_after_step(one_rank) -> None:
    """The mode is the schedule's: a synchronous stream is train_step after train_step, loss for loss and weight
    for weight (the optimizer steps through the schedule's STEP actions)."""
    data = _batches(3)
    streamed = sw.Pipeline(_layers(), loss_fn=F.mse_loss, schedule="zb-h1", microbatches=3, optimizer=_sgd, seed=2)
    stepped = sw.Pipeline(_layers(), loss_fn=F.mse_loss, schedule="zb-h1", microbatches=3, optimizer=_sgd, seed=2)
    losses = list(streamed.train_stream(iter(data), steps=2))
    assert losses == [stepped.train_step(x, y) for x, y in data[:2]]  # steps=2 of 3: the third is not taken
    for (name, a), (_, b) in zip(streamed.named_parameters(), stepped.named_parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    assert list(streamed.train_stream(data, steps=0)) == []
    with pytest.raises(ValueError, match="asynchronous"):
        sw.Pipeline(_layers(), loss_fn=F.mse_loss, schedule="pipedream", optimizer=_sgd).train_step(*data[0])


def _het(schedule: str) -> sw.HetPipe:
    return sw.HetPipe(_layers(), virtual_workers=[[0]], schedule=schedule, microbatches=2, optimizer=_sgd,
                      loss_fn=F.mse_loss, seed=3)  # fmt: skip


@pytest.mark.parametrize("schedule", ["1f1b", "pipedream"])
def test_hetpipe_streams_some_steps_then_evaluates_the_global_model(one_rank, schedule: str) -> None:
    """One virtual worker with D = 0 is plain training: W0 + G/K with K = 1 after every wave."""
    data = _batches(3)
    het = _het(schedule)
    losses = list(het.train_stream(data, steps=2))
    assert len(losses) == 2 and het.stats.waves >= 1
    if schedule == "1f1b":  # synchronous waves: SGD on the one-process model, step for step
        ref = sw.build_model(_layers(), seed=3)
        opt = _sgd(list(ref.parameters()))
        for (x, y), loss in zip(data[:2], losses):
            opt.zero_grad()
            expected = F.mse_loss(ref(x), y)
            expected.backward()
            opt.step()
            assert loss == pytest.approx(expected.item(), rel=1e-12)
        with torch.no_grad():
            torch.testing.assert_close(het.eval_step(data[2][0]), ref(data[2][0]), rtol=1e-12, atol=1e-14)
    with pytest.raises(ValueError, match="steps must be >= 0"):
        list(het.train_stream(data, steps=-1))


def test_hetpipe_declares_the_checkpoint_protocol_and_round_trips(one_rank, tmp_path: Path) -> None:
    het = _het("1f1b")
    assert isinstance(het, SavedInParts) and SavedInParts in type(het).__mro__  # declared, not duck-typed
    data = _batches(3)
    list(het.train_stream(data[:2]))
    sw.checkpoint.save(tmp_path / "ckpt", het, step=2)
    loaded = _het("1f1b")
    info = sw.checkpoint.load(tmp_path / "ckpt", loaded)
    assert info.step == 2 and loaded.stats.waves == het.stats.waves
    torch.testing.assert_close(loaded.eval_step(data[2][0]), het.eval_step(data[2][0]), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"parallel": sw.ParallelConfig(pp=1)}, "does not take parallel=: each virtual worker's pipeline"),
        ({"batchnorm": "deferred"}, "does not take batchnorm=: the wave rule shares parameters only"),
        ({"nan_policy": "skip"}, "does not take nan_policy='skip'"),
        ({"optimizer": None}, "needs optimizer="),
        ({"loss_fn": None}, "needs loss_fn="),
    ],
)
def test_every_refusal_of_hetpipe_is_in_combinations(options: dict[str, Any], words: str) -> None:
    """Pure in the layers and the options: no group, no process."""
    given = {"optimizer": _sgd, "loss_fn": F.mse_loss} | options
    with pytest.raises(ValueError, match=words):
        refuse_hetpipe(_layers(), Options.of("HetPipe", None, given))
    tied = [sw.Tied("emb", nn.Linear(4, 4)), sw.Layer(nn.Linear, 4, 4), sw.Tied("emb", nn.Linear(4, 4))]
    with pytest.raises(ValueError, match="does not take tied modules"):
        refuse_hetpipe(tied, Options.of("HetPipe", None, {"optimizer": _sgd, "loss_fn": F.mse_loss}))
    assert set(HETPIPE_REFUSED) >= {"group", "parallel", "batchnorm"}
