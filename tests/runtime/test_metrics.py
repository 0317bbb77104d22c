"""What a pipeline reports (issue 50 part 1, issue 51 item 4), on a one-rank process group.

``metrics=DIR`` writes each step's values to ``DIR/rank0.jsonl`` and TensorBoard event files, read back here with
TensorBoard's own reader and checked against what ``train_step`` returned and what the test set (the learning
rate) or can recount (the batch, the times' sum); an unwritable folder or a full disk is one log line and training
goes on; the progress line, the events, ``memory_report`` in the planner's terms and ``timeline()`` kept for the
last train step even after an eval.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import stagewise as sw
from helpers import models as mdl
from stagewise.cli.run import metrics_env
from stagewise.planning.result import RankMemory
from stagewise.runtime.reporting import files, progress, reporter, sinks
from stagewise.runtime.reporting.config import METRICS_ENV, MetricsConfig, metrics_config

SINKS, PROGRESS, EVENTS = sinks.__name__, progress.__name__, reporter.__name__
BATCH = 6
LRS = (0.25, 0.125, 0.0625)
TAGS = {
    "loss", "lr", "throughput/samples_per_s", "throughput/tokens_per_s", "time/step", "time/compute",
    "time/transfer", "time/sync_step", "time/waiting", "bubble", "memory/parameters", "skipped_steps",
}  # fmt: skip


def _pipe(**kw: Any) -> sw.Pipeline:
    return sw.Pipeline(mdl.lm(), loss_fn=mdl.lm_loss, schedule="1f1b", microbatches=3, seed=5, **kw)


def _train(pipe: sw.Pipeline, steps: int = 3, clip: bool = False) -> tuple[list[float], list[float]]:
    """``steps`` steps with the learning rate of LRS set before each, SGD held by the user (and watched)."""
    opt = torch.optim.SGD(pipe.parameters(), lr=1.0)
    pipe.metrics.watch(opt)
    losses, norms = [], []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = LRS[step % len(LRS)]
        losses.append(pipe.train_step(*mdl.lm_data(BATCH, seed=step)))
        if clip:
            norms.append(pipe.clip_grad_norm_(0.5))
        opt.step()
        opt.zero_grad()
    return losses, norms


def _scalars(folder: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def test_tensorboard_holds_each_step_s_values(one_rank, tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    pipe = _pipe(metrics=tmp_path)
    losses, norms = _train(pipe, clip=True)
    pipe.metrics.close()
    tb = _scalars(tmp_path / "rank0")
    assert TAGS | {"grad_norm"} <= set(tb)
    steps = [1, 2, 3]
    assert [tb["loss"][s] for s in steps] == pytest.approx(losses, rel=1e-6)  # (TensorBoard keeps float32)
    assert [tb["lr"][s] for s in steps] == pytest.approx(list(LRS), rel=1e-7)
    assert [tb["grad_norm"][s] for s in steps] == pytest.approx(norms, rel=1e-6)
    assert all(n > 0 for n in norms)
    params = sum(p.numel() * p.element_size() for p in pipe.parameters())
    for s in steps:
        wall = tb["time/step"][s]
        assert tb["throughput/samples_per_s"][s] * wall == pytest.approx(BATCH, rel=1e-5)
        assert tb["throughput/tokens_per_s"][s] * wall == pytest.approx(BATCH * mdl.SEQ, rel=1e-5)
        parts = sum(tb[f"time/{k}"][s] for k in ("compute", "transfer", "sync_step", "waiting"))
        assert parts == pytest.approx(wall, rel=1e-5)
        assert tb["bubble"][s] == pytest.approx(1 - tb["time/compute"][s] / wall, abs=1e-6)
        assert tb["memory/parameters"][s] == params
        assert tb["skipped_steps"][s] == 0


def test_the_json_lines_hold_the_same_values_exactly(one_rank, tmp_path: Path) -> None:
    pipe = _pipe(metrics=MetricsConfig(tmp_path, tensorboard=False), measure_memory=True)
    losses, _ = _train(pipe)
    pipe.metrics.event("relayout", ranks=[0, 1], reason="a machine came back")
    records = files.read_metrics(tmp_path)
    assert [loss for _, loss in files.series(records, "loss")] == losses  # float64, bit for bit
    assert files.series(records, "lr") == list(zip([1, 2, 3], LRS))
    assert files.series(records, "memory/activations_peak")[-1][1] == pipe.memory_report()["activations"] > 0
    event = records[-1]
    assert event["event"] == "relayout" and event["step"] == 3 and event["ranks"] == [0, 1]
    assert not (tmp_path / "rank0").exists()  # tensorboard=False: JSON lines only


def test_events_reach_tensorboard_and_rank_0_s_log(one_rank, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("tensorboard")
    pipe = _pipe(metrics=tmp_path)
    _train(pipe, steps=2)
    with caplog.at_level(logging.INFO, logger=EVENTS):
        pipe.metrics.event("straggler", rank=3, slower=1.8)
        pipe.metrics.event("straggler", step=7, rank=2)
    pipe.metrics.close()
    assert _scalars(tmp_path / "rank0")["events/straggler"] == {2: 1.0, 7: 2.0}
    assert [r.getMessage() for r in caplog.records] == [
        "step 2: straggler rank=3 slower=1.8",
        "step 7: straggler rank=2",
    ]


def test_an_unwritable_folder_is_one_line_and_training_goes_on(
    one_rank, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with caplog.at_level(logging.WARNING, logger=SINKS):
        pipe = _pipe(metrics=blocker / "runs")  # a folder under a file: no folder can be made there
        losses, _ = _train(pipe, steps=2)
    assert len(losses) == 2
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1, lines
    assert "cannot write" in lines[0] and "training goes on" in lines[0]


@pytest.fixture
def read_only(tmp_path: Path) -> Iterator[Path]:
    """A read-only folder: permissions 0500, or, for root (whom permissions do not stop), a read-only tmpfs."""
    folder = tmp_path / "ro"
    folder.mkdir()
    if os.geteuid() != 0:
        folder.chmod(0o500)
        yield folder
        folder.chmod(0o700)
        return
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(folder)], capture_output=True)
    if mount.returncode != 0:
        pytest.skip(f"root, and no read-only tmpfs could be mounted: {mount.stderr!r}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)


@pytest.mark.parametrize("where", ["the folder itself", "a folder under it"])
def test_a_read_only_folder_is_one_line(
    one_rank, read_only: Path, where: str, caplog: pytest.LogCaptureFixture
) -> None:
    folder = read_only if where == "the folder itself" else read_only / "runs"
    with caplog.at_level(logging.WARNING, logger=SINKS):
        pipe = _pipe(metrics=folder)
        losses, _ = _train(pipe, steps=2)
    assert len(losses) == 2
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "cannot write" in lines[0] and "training goes on" in lines[0], lines


def test_a_full_disk_is_one_line_and_training_goes_on(
    one_rank, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The JSON lines go to /dev/full (every write: ENOSPC); the TensorBoard writer raises ENOSPC too."""
    (tmp_path / "rank0.jsonl").symlink_to("/dev/full")
    pipe = _pipe(metrics=tmp_path)
    board = [s for s in pipe.metrics.sinks if isinstance(s, sinks.TensorBoard)]

    class Full:
        def add_scalar(self, *args: Any) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        close = flush = add_text = add_scalar

    for sink in board:
        sink.writer = Full()
    with caplog.at_level(logging.WARNING, logger=SINKS):
        losses, _ = _train(pipe, steps=3)
    assert len(losses) == 3
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and board, lines  # once, for both sinks
    assert "No space left on device" in lines[0] and "training goes on" in lines[0]
    assert all(s.writer is None for s in board)  # (both stopped writing)


def test_without_tensorboard_the_json_lines_still_come(
    one_rank, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sinks, "tensorboard_installed", lambda: False)
    with caplog.at_level(logging.WARNING, logger=SINKS):
        pipe = _pipe(metrics=tmp_path)
        losses, _ = _train(pipe, steps=2)
    said = "stagewise metrics: TensorBoard is not installed (pip install tensorboard); metrics go to"
    assert [r.getMessage() for r in caplog.records] == [f"{said} {tmp_path}/rank*.jsonl only"]
    assert [v for _, v in files.series(files.read_metrics(tmp_path), "loss")] == losses


def test_rank_0_logs_a_progress_line_every_n_steps(one_rank, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger=PROGRESS):
        losses, _ = _train(_pipe(), steps=3)
        _train(_pipe(progress=2), steps=3)
        _train(_pipe(progress=False), steps=3)
    lines = [r.getMessage() for r in caplog.records if r.name == PROGRESS]
    assert [line.split("  ")[:3] for line in lines[:3]] == [
        [f"step {s + 1}", f"loss {loss:.4f}", f"lr {LRS[s]:.2e}"] for s, loss in enumerate(losses)
    ]
    assert [line.split("  ")[0] for line in lines[3:]] == ["step 2"]
    assert all("samples/s" in line and "tokens/s" in line and "bubble" in line for line in lines)


def test_timeline_describes_the_last_train_step_after_an_eval(one_rank) -> None:
    pipe = _pipe()
    _train(pipe, steps=1)
    train = pipe.timeline()
    x, _ = mdl.lm_data(BATCH, seed=9)
    pipe.eval_step(x)
    assert pipe.last_step.mode == "eval"
    after = pipe.timeline()
    assert after.meta["mode"] == "train" and after.events == train.events
    assert [e.action for e in after.events] == list(pipe.schedule.ranks[0])
    evaluated = pipe.timeline(mode="eval")
    assert evaluated.meta["mode"] == "eval" and [e.action for e in evaluated.events] == list(
        pipe.eval_schedule.ranks[0]
    )
    with pytest.raises(ValueError, match="mode must be 'train' or 'eval'"):
        pipe.timeline(mode="test")


def test_memory_report_counts_the_planner_s_four_terms(one_rank) -> None:
    pipe = _pipe(measure_memory=True)
    opt = torch.optim.Adam(pipe.parameters(), lr=1e-3)
    pipe.metrics.watch(opt)
    pipe.train_step(*mdl.lm_data(BATCH, seed=0))
    opt.step()
    report = pipe.memory_report()
    planner = set(RankMemory(0, 0, 0, 0, 0).to_dict()) - {"cap"}
    assert planner <= set(report)
    params = sum(p.numel() * p.element_size() for p in pipe.parameters())
    assert report["parameters"] == params
    assert report["gradients"] == params  # every parameter has its gradient after the step
    assert report["optimizer"] == 2 * params  # Adam: exp_avg and exp_avg_sq (the step counts are not counted)
    assert report["activations"] == report["peak_bytes"] > 0
    assert report["total"] == 4 * params + report["activations"]
    assert _pipe().memory_report()["activations"] is None  # without measure_memory=True


def test_gather_state_dict_in_one_process_is_the_state_dict(one_rank) -> None:
    pipe = _pipe()
    gathered = files.gather_state_dict(pipe)
    assert gathered is not None and gathered.keys() == pipe.state_dict().keys()
    for k, v in pipe.state_dict().items():
        assert torch.equal(gathered[k], v)


def test_gather_state_dict_takes_each_name_from_the_lowest_rank_and_refuses_two_kinds() -> None:
    """Replicas and shard ranks hold the same names: each is sent once, by the lowest rank holding it (DDP keeps
    rank 0's buffers); one name as two tensors is no replica, and is refused naming both ranks."""
    w, b, r = ["w", "float64", [2, 3]], ["b", "float64", [3]], ["running_mean", "float32", [3]]
    assert files.owners([[w, b], [r, w, b], [w, r]]) == {"w": 0, "b": 0, "running_mean": 1}
    assert files.owners([[], [b], [b, w]]) == {"b": 1, "w": 2}
    with pytest.raises(ValueError, match=r"rank 2 holds 'w' as float32 \[2, 3\], rank 0 as float64 \[2, 3\]"):
        files.owners([[w], [w], [["w", "float32", [2, 3]]]])
    with pytest.raises(ValueError, match=r"rank 1 holds 'b' as float64 \[4\]"):
        files.owners([[b], [["b", "float64", [4]]]])


def test_the_metrics_option_and_its_environment_variable() -> None:
    assert metrics_config(None, {}) is None
    assert metrics_config(None, {METRICS_ENV: "runs/a"}) == MetricsConfig("runs/a")
    assert metrics_config("runs/b", {METRICS_ENV: "runs/a"}) == MetricsConfig("runs/b")
    assert set(metrics_env("runs/c")) == {METRICS_ENV}  # what `stagewise run --metrics` sets is what is read
    with pytest.raises(ValueError, match="every must be an integer >= 1"):
        sw.Options(metrics=MetricsConfig("runs", every=0))
    with pytest.raises(TypeError, match="metrics must be a folder"):
        sw.Options(metrics=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="progress must be True, False or a number of steps"):
        sw.Options(progress=-1)


def test_the_json_lines_are_plain_json(one_rank, tmp_path: Path) -> None:
    pipe = _pipe(metrics=MetricsConfig(tmp_path, tensorboard=False, every=2))
    _train(pipe, steps=3)
    lines = (tmp_path / "rank0.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [2]  # every=2


def test_an_asynchronous_window_writes_each_mini_batch_s_loss(one_rank, tmp_path: Path) -> None:
    pipe = _pipe_async(tmp_path)
    stream = [mdl.lm_data(BATCH, seed=k) for k in range(5)]
    losses = list(pipe.train_stream(stream))
    records = files.read_metrics(tmp_path)
    assert files.series(records, "loss") == list(enumerate(losses, start=1))
    assert len(files.series(records, "time/step")) < len(losses)  # a window's times once, at its last step


def _pipe_async(folder: Path) -> sw.Pipeline:
    return sw.Pipeline(
        mdl.lm(), loss_fn=mdl.lm_loss, schedule="pipedream", microbatches=2, seed=5, progress=False,
        metrics=MetricsConfig(folder, tensorboard=False), optimizer=lambda p: torch.optim.SGD(p, lr=0.01),
    )  # fmt: skip


def test_the_learning_rate_is_the_one_the_step_trained_with(one_rank, tmp_path: Path) -> None:
    """``optimizer=`` with ``lr_scheduler=``: the scheduler steps at the step's end, and the lr written was read
    after it, one step ahead (2026-12-06: 0.002, 0.003 for a step run at 0.001)."""
    lrs: list[float] = []
    warmup = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda k: (k + 1) / 3)  # noqa: E731
    pipe = _pipe(metrics=tmp_path, optimizer=lambda p: torch.optim.SGD(p, lr=3e-3), lr_scheduler=warmup)
    for step in range(3):
        lrs.append(pipe.optimizers[0].param_groups[0]["lr"])  # what this step trains with
        pipe.train_step(*mdl.lm_data(BATCH, seed=step))
    pipe.metrics.close()
    rows = [json.loads(line) for line in (tmp_path / "rank0.jsonl").read_text().splitlines()]
    assert [r["lr"] for r in rows if "lr" in r] == pytest.approx([1e-3, 2e-3, 3e-3], rel=1e-12) == lrs


def test_tokens_are_counted_from_a_tuple_s_or_a_dict_s_input_ids() -> None:
    """Stage 0 of a transformers model holds ``(input_ids, attention_mask)`` or a tokenizer's dict: its tokens
    were not counted (no ``throughput/tokens_per_s`` there); a float tensor first is no tokens."""
    from stagewise.runtime.reporting.record import batch_counts

    ids, mask = torch.zeros(2, 8, dtype=torch.long), torch.ones(2, 8, dtype=torch.long)
    assert batch_counts([(ids, mask)] * 3, None, (0, 0)) == {"samples": 6, "tokens": 48}
    assert batch_counts([{"input_ids": ids, "attention_mask": mask}], None, (0, 0))["tokens"] == 16
    assert "tokens" not in batch_counts([(torch.zeros(2, 8), ids)], None, (0, 0))


def test_memory_report_counts_offloaded_state_on_the_host(one_rank) -> None:
    """``offload="optimizer"``: the stages' optimizer state is host memory, out of ``optimizer`` and ``total``;
    ``host`` holds it with each parameter's master and gradient buffer. A watched optimizer stays on the device."""
    pipe = _pipe(optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3), offload="optimizer")
    extra = torch.nn.Parameter(torch.zeros(5, 7))  # (a user's optimizer may not step the pipeline's parameters)
    extra.grad = torch.ones_like(extra)
    watched = torch.optim.SGD([extra], lr=0.0, momentum=0.9)
    pipe.metrics.watch(watched)
    pipe.train_step(*mdl.lm_data(BATCH, seed=0))
    watched.step()
    report = pipe.memory_report()
    params = sum(p.numel() * p.element_size() for p in pipe.parameters())
    state = [v for opt in pipe.optimizers.values() for st in opt.state.values() for v in st.values()]
    assert len(state) == 3 * len(list(pipe.parameters()))  # AdamW: step, exp_avg, exp_avg_sq, made on the host
    momentum = extra.numel() * extra.element_size()
    assert report["optimizer"] == momentum  # the watched SGD's only
    assert report["host"] == 2 * params + sum(v.numel() * v.element_size() for v in state)  # masters, grads
    assert report["gradients"] == 0  # (the stages' optimizers clear them at STEP)
    assert report["total"] == params + momentum
    assert "host" not in _pipe(optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3)).memory_report()
