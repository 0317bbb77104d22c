"""The matrix columns of what a step reports and what the pipeline's own optimizers do besides stepping:
``metrics=``, ``progress=``, ``lr_scheduler=``, ``clip=`` (issue 51), each against the one-process model."""

from __future__ import annotations

import logging
from typing import Any

import torch

from helpers.compare import assert_params_close
from matrix_build import CLIP, build, sgd, warmup
from matrix_models import Built
from matrix_reference import ref_named, train_compare
from stagewise.runtime.reporting.files import read_metrics, series
from worker import Ctx


def _step(b: Built, step: int, opt: torch.optim.Optimizer, clip: float | None = None) -> tuple[float, float, float]:
    """One step of the pipeline and of the twin (clipped to ``clip`` like torch's clip_grad_norm_ on the whole
    model); the pipeline's loss, the twin's, and the twin's gradient norm before the clip (0 without one)."""
    assert b.ref is not None
    x, y = b.data(step)
    loss = b.pipe.train_step(*b.pipe.local_batch(x, y))
    opt.zero_grad(set_to_none=True)
    want = b.loss_fn(b.ref(x), y)
    want.backward()
    norm = 0.0 if clip is None else float(torch.nn.utils.clip_grad_norm_(b.ref.parameters(), clip))
    opt.step()
    return loss, float(want), norm


def metrics(row: str, column: str, ctx: Ctx) -> dict[str, Any]:
    """Two steps exact with ``metrics=``; this rank's JSON lines hold each step's loss, bit-equal to train_step's."""
    b = build(row, column, ctx)
    losses = train_compare(b, f"{row} x metrics=")
    b.pipe.metrics.close()
    folder = b.pipe.metrics.config.path
    written = [v for _, v in series(read_metrics(folder, b.pipe.process_rank), "loss")][-2:]
    assert written == losses, f"{row} x metrics=: the file says {written}, train_step returned {losses}"
    return {"losses": losses}


def progress(row: str, column: str, ctx: Ctx) -> dict[str, Any]:
    """Two steps exact with ``progress=1``; process rank 0 logs one line per step naming the step and its loss."""
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    log = logging.getLogger("stagewise.runtime.reporting.progress")
    old = log.level
    log.setLevel(logging.INFO)
    log.addHandler(handler)
    try:
        b = build(row, column, ctx)
        losses = train_compare(b, f"{row} x progress=")
    finally:
        log.removeHandler(handler)
        log.setLevel(old)
    if b.pipe.process_rank == 0:
        assert len(lines) == 2 and all(f"step {k + 1} " in s for k, s in enumerate(lines)), lines
        assert all(f"loss {loss:.4f}" in s for loss, s in zip(losses, lines)), (lines, losses)
    else:
        assert lines == [], lines
    return {"lines": lines}


def lr_scheduler(row: str, column: str, ctx: Ctx) -> dict[str, Any]:
    """Three steps with a warm-up scheduler (lr x 0.5, 1, 1.5) against the twin's SGD stepped by the same
    scheduler: loss and every parameter after each step (a pipeline ignoring it is off at the first step)."""
    b = build(row, column, ctx)
    opt = sgd(list(b.ref.parameters()))  # type: ignore[union-attr]
    schedule = warmup(opt)
    losses = []
    for step in range(3):
        loss, want, _ = _step(b, step, opt)
        schedule.step()
        assert abs(loss - want) <= 1e-10 * (1 + abs(want)), (row, step, loss, want)
        assert_params_close(b.pipe, ref_named(b, b.pipe), f"{row} x lr_scheduler= step {step}", aliases=True)
        losses.append(loss)
    return {"losses": losses, "lr": schedule.get_last_lr()}


def clip(row: str, column: str, ctx: Ctx) -> dict[str, Any]:
    """``clip=`` over the hybrid axes (:data:`matrix_build.CLIP_LAYOUT`: dp copies, sharded pieces, tied weights
    counted once): the norm the pipeline clipped by equals torch's ``clip_grad_norm_`` of the whole one-process
    model's gradient (float64, 1e-10), above the max norm (so the clip acts), and the parameters follow."""
    b = build(row, column, ctx)
    opt = sgd(list(b.ref.parameters()))  # type: ignore[union-attr]
    norms = []
    for step in range(2):
        loss, want, norm = _step(b, step, opt, CLIP)
        assert norm > 2 * CLIP, f"{row} x clip=: the norm {norm} does not exceed {CLIP}: the clip would not act"
        got = b.pipe.metrics.last["grad_norm"]
        assert abs(got - norm) <= 1e-10 * norm, f"{row} x clip= step {step}: norm {got} vs one process {norm}"
        assert abs(loss - want) <= 1e-10 * (1 + abs(want)), (row, step, loss, want)
        assert_params_close(b.pipe, ref_named(b, b.pipe), f"{row} x clip= step {step}", aliases=True)
        norms.append(got)
    return {"norms": norms}
