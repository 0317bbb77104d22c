"""Train a small GPT on the Python standard library's source, pipelined over N processes.

    stagewise run -n 4 examples/gpt_stdlib.py --out out/demo     # 4 stages, 4 local processes
    python examples/gpt_stdlib.py --single --out out/demo-single # the same model in one process

Each process builds only its stage's layers (``sw.Layer`` specs), draws the
same batches (same seed) and passes them to ``pipe.train_step``: stage 0 uses
the inputs, the last stage the targets. The rank holding the last stage shows
the progress and writes, under ``--out``:

* ``metrics/``: the pipeline's own per-step metrics (``metrics=``): ``rank{R}.jsonl`` and, with tensorboard
  installed, TensorBoard event files (``tensorboard --logdir OUT/metrics``): loss, learning rate, tokens/s,
  compute / waiting / transfer time, bubble, memory, validation loss;
* ``loss_curve.png`` and ``metrics.csv``: training loss per step, validation loss (both modes);
* ``timeline_measured.png`` / ``.trace.json``: one measured step (open the trace in ui.perfetto.dev);
* ``timeline_simulated.png`` / ``.trace.json``: the simulator's prediction from the measured per-stage
  compute times, and ``timeline_compare.png`` with both;
* ``checkpoints/step-N``: a checkpoint every ``--save-every`` steps and at the end (the last
  ``--keep``), written with :mod:`stagewise.checkpoint`: the model under its one-process names
  (the tied token embedding once), the optimizer state by parameter name, RNG states, and in
  ``extra`` the config, the seed and how many batches were drawn. A run finding a checkpoint there
  resumes from it (``--no-resume`` starts afresh), under any number of processes or ``--single``;
  ``sw.checkpoint.load(sw.checkpoint.latest(OUT / "checkpoints"), sw.build_model(gpt_layers(cfg)))``
  loads it into the one-process model;
* ``summary.json``: the numbers of the summary table.

``--stop-at N`` stops after step N as if the job had been killed; run the same command again
without it and training continues from the last checkpoint. Under
``stagewise run -n 4 --max-restarts 3 examples/gpt_stdlib.py ...`` a rank that dies restarts the
job, which resumes from the last checkpoint by itself (``sw.checkpoint.resume``).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import stagewise as sw
from gpt_data import STDLIB_FILES, Batch, batches, eval_batches, split, stdlib_corpus
from gpt_model import GPTConfig, generate, gpt_layers, lm_loss
from reporting import MetricsLog, TrainingProgress, console, measured_costs, summary_table, typical, write_timelines
from stagewise.runtime import plot_losses


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=None, help="output folder (default out/gpt, or out/gpt-single)")
    p.add_argument("--single", action="store_true", help="train the same model in one process, no pipeline")
    p.add_argument("--steps", type=int, default=600, help="training steps (default 600)")
    p.add_argument("--batch-size", type=int, default=32, help="sequences per step (default 32)")
    p.add_argument("--microbatches", type=int, default=8, help="micro-batches per step (default 8)")
    p.add_argument("--schedule", default="1f1b", help="pipeline schedule (see `stagewise schedules`)")
    p.add_argument(
        "--partition",
        default="parameters",
        help="'parameters' (default: balances the blocks), 'uniform' or layer counts like 3,2,2,3",
    )
    p.add_argument("--layers", type=int, default=6, help="transformer blocks (default 6)")
    p.add_argument("--d-model", type=int, default=64, help="width (default 64)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    p.add_argument("--seq-len", type=int, default=64, help="bytes per sequence (default 64)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate of AdamW (default 3e-3)")
    p.add_argument("--warmup", type=int, default=30, help="linear warm-up steps, then cosine decay (default 30)")
    p.add_argument("--eval-every", type=int, default=50, help="validation every N steps (default 50)")
    p.add_argument("--eval-batches", type=int, default=8, help="validation batches (default 8)")
    p.add_argument("--timeline-every", type=int, default=10, help="measure the bubble every N steps (default 10)")
    p.add_argument("--sample", type=int, default=200, help="bytes of text to sample at the end (default 200)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1, as torchrun sets)")
    p.add_argument("--seed", type=int, default=0, help="seed of the model and the batches (default 0)")
    p.add_argument("--save-every", type=int, default=100, help="checkpoint every N steps, and at the end (100)")
    p.add_argument("--keep", type=int, default=2, help="checkpoints to keep (default 2)")
    p.add_argument("--no-resume", action="store_true", help="ignore existing checkpoints under OUT/checkpoints")
    p.add_argument("--stop-at", type=int, default=None, help="stop after this step, as if interrupted")
    p.add_argument("--no-progress", action="store_true", help="no progress bar or step lines")
    p.add_argument("--verbose", action="store_true", help="log stagewise's INFO messages")
    args = p.parse_args(argv)
    if args.out is None:
        args.out = Path("out/gpt-single" if args.single else "out/gpt")
    if args.single and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        p.error("--single trains in one process: run `python examples/gpt_stdlib.py --single`, not under a launcher")
    names = ("steps", "threads", "batch_size", "microbatches", "eval_every", "eval_batches", "timeline_every")
    for name in (*names, "save_every", "keep"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up to ``--lr``, then cosine decay to a tenth of it."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def adamw(lr: float) -> Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]:
    """The optimizer factory: the pipeline makes one per stage (AdamW is per-parameter, so that changes nothing)."""
    return lambda params: torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)


# ---- the two ways to run the same model -------------------------------------------------------


class Pipelined:
    """The model cut into stages over the processes (more than one each with a V schedule).

    The rank holding the last stage reports: it has the loss and the logits.
    """

    def __init__(self, layers: dict[str, sw.Layer], args: argparse.Namespace) -> None:
        sw.init()
        partition: Any = args.partition
        if partition[0].isdigit():
            partition = [int(c) for c in partition.split(",")]
        self.pipe = sw.Pipeline(
            layers,
            loss_fn=lm_loss,
            schedule=args.schedule,
            microbatches=args.microbatches,
            partition=partition,
            seed=args.seed,
            optimizer=adamw(args.lr),
            metrics=args.out / "metrics",  # JSON lines, and TensorBoard when installed
            progress=False,  # (the script draws its own progress bar)
        )
        self.schedule = self.pipe.schedule
        self.reporter_rank = self.schedule.placement[-1]
        self.reports = self.pipe.rank == self.reporter_rank
        self.optimizers = list(self.pipe.optimizers.values())

    def describe(self) -> str:
        s = self.schedule
        ranges = [str(r.start) if len(r) == 1 else f"{r.start}-{r.stop - 1}" for r in self.pipe.layer_ranges]
        return (
            f"{_plural(s.num_ranks, 'process', 'processes')}, schedule {s.name}, "
            f"{_plural(s.num_microbatches, 'micro-batch', 'micro-batches')}, "
            f"{_plural(s.num_stages, 'stage')} holding layers {', '.join(ranges)}"
        )

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        return self.pipe.train_step(x, y)

    def eval_loss(self, data: list[Batch]) -> float | None:
        losses = []
        for x, y in data:
            logits = self.pipe.eval_step(x)
            if self.reports:
                losses.append(float(lm_loss(logits, y)))
        if not self.reports:
            return None
        self.pipe.metrics.log(val_loss=statistics.fmean(losses))  # beside the step's metrics
        return statistics.fmean(losses)

    def timeline(self) -> sw.Timeline:
        return self.pipe.timeline(gather=True)

    @property
    def model(self) -> torch.nn.Module:
        """What is checkpointed: the pipeline (every rank its share); its own per-stage optimizers go with it."""
        return self.pipe

    optimizer = None

    def close(self) -> None:
        dist.destroy_process_group()


class SingleProcess:
    """The same layers, seed, data and optimizer in one process: the reference."""

    schedule = None
    reports = True

    def __init__(self, layers: dict[str, sw.Layer], args: argparse.Namespace) -> None:
        self.model = sw.build_model(layers, seed=args.seed)
        self.optimizers = [adamw(args.lr)(list(self.model.parameters()))]

    def describe(self) -> str:
        threads = torch.get_num_threads()
        return f"one process ({threads} thread{'s' if threads > 1 else ''}), no pipeline"

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        loss = lm_loss(self.model(x), y)
        loss.backward()
        self.optimizers[0].step()
        self.optimizers[0].zero_grad(set_to_none=True)
        return loss.item()

    @torch.no_grad()
    def eval_loss(self, data: list[Batch]) -> float:
        return statistics.fmean(float(lm_loss(self.model(x), y)) for x, y in data)

    def timeline(self) -> None:
        return None

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.optimizers[0]

    def close(self) -> None:
        pass


# ---- training -----------------------------------------------------------------------------------


def checkpoint(runner: Pipelined | SingleProcess, args: argparse.Namespace, cfg: GPTConfig, step: int) -> None:
    """Save the model, its optimizer state and RNG after ``step`` (a collective in the pipelined run)."""
    extra = {"config": asdict(cfg), "seed": args.seed, "steps": args.steps, "batches_drawn": step}
    where = args.out / "checkpoints"
    sw.checkpoint.save(where, runner.model, runner.optimizer, step=step, extra=extra, keep=args.keep)


def resume(runner: Pipelined | SingleProcess, args: argparse.Namespace, cfg: GPTConfig) -> int:
    """Load the newest checkpoint under ``OUT/checkpoints`` if there is one; the step it was saved after."""
    if args.no_resume:
        return 0
    info = sw.checkpoint.resume(args.out / "checkpoints", runner.model, runner.optimizer)  # None: nothing saved yet
    if info is None:
        return 0
    saved = info.extra
    if saved["config"] != asdict(cfg) or saved["seed"] != args.seed or saved["steps"] != args.steps:
        raise SystemExit(
            f"{info.path} was saved by a run with other settings ({saved}); use --no-resume or another --out"
        )
    if runner.reports:
        console.print(f"resuming from {info.path} (step {info.step})")
    return int(saved["batches_drawn"])


def train(
    runner: Pipelined | SingleProcess,
    args: argparse.Namespace,
    cfg: GPTConfig,
    train_data: torch.Tensor,
    valid: list[Batch],
    start: int = 0,
) -> tuple[MetricsLog | None, list[sw.Timeline], float, int]:
    """The loop from step ``start + 1``; returns the metrics log, the kept measured timelines, the training
    seconds and the last step done (``--stop-at`` may end it early)."""
    metrics = MetricsLog(args.out, start) if runner.reports else None  # a resume keeps the earlier rows
    progress = TrainingProgress(args.steps, unit="tok/s", enabled=runner.reports and not args.no_progress)
    tokens = args.batch_size * args.seq_len
    recent: deque[float] = deque(maxlen=20)
    timelines: list[sw.Timeline] = []
    bubble = None
    val = runner.eval_loss(valid)
    if metrics is not None:
        metrics.log(start, val_loss=val)
    data = batches(train_data, args.batch_size, args.seq_len, seed=args.seed)
    for _ in range(start):  # the data position: the batches the saved run had drawn
        next(data)
    stop = args.steps if args.stop_at is None else min(args.steps, args.stop_at)
    busy = 0.0
    step = start
    try:
        for step in range(start + 1, stop + 1):
            lr = lr_at(step - 1, args)
            for opt in runner.optimizers:
                for group in opt.param_groups:
                    group["lr"] = lr
            x, y = next(data)
            started = time.perf_counter()
            loss = runner.train_step(x, y)
            recent.append(time.perf_counter() - started)
            busy += recent[-1]
            if runner.schedule is not None and (step % args.timeline_every == 0 or step == args.steps):
                timeline = runner.timeline()  # a collective: every rank calls it at the same steps
                bubble = timeline.bubble_ratio
                timelines = (timelines + [timeline])[-10:]
            val = runner.eval_loss(valid) if step % args.eval_every == 0 or step == args.steps else None
            if metrics is not None:
                rate = tokens * len(recent) / sum(recent)
                metrics.log(step, loss=loss, lr=lr, rate=rate, bubble=bubble, val_loss=val)
                progress.update(step, loss, rate, bubble)
            if step % args.save_every == 0 or step == stop:
                checkpoint(runner, args, cfg, step)
    finally:
        progress.close()
        if metrics is not None:
            metrics.close()
    return metrics, timelines, busy, step


def report(
    runner: Pipelined | SingleProcess,
    args: argparse.Namespace,
    cfg: GPTConfig,
    metrics: MetricsLog,
    timelines: list[sw.Timeline],
    busy: float,
    wall: float,
    valid: list[Batch],
) -> None:
    """Write the figures and summary.json, load the last checkpoint into the one-process model, print the table."""
    out = args.out
    mode = "single process" if args.single else f"{runner.schedule.num_ranks} pipeline stages"
    losses = metrics.series("loss")
    vals = metrics.series("val_loss")
    final_train = statistics.fmean(loss for _, loss in losses[-20:])
    plot_losses(losses, vals, out / "loss_curve.png", title=f"GPT on stdlib source, {mode}")
    # the checkpoint holds the whole model under its one-process names: load it there, in this
    # process alone (into differently initialised weights, so that the check means something)
    model = sw.build_model(gpt_layers(cfg), seed=args.seed + 1)
    sw.checkpoint.load(out / "checkpoints", model, collective=False)
    with torch.no_grad():
        reloaded = statistics.fmean(float(lm_loss(model(x), y)) for x, y in valid)
    parameters = sum(p.numel() for p in model.parameters())  # the tied embedding once
    trained = len(losses)
    tokens_per_s = trained * args.batch_size * args.seq_len / busy
    rows = [
        ("mode", runner.describe()),
        ("model", f"{parameters:,} parameters (embedding tied to the head), {cfg.n_layers} blocks, d={cfg.d_model}"),
        ("data", f"{trained} steps x {args.batch_size} x {args.seq_len} bytes"),
        ("train loss", f"{losses[0][1]:.3f} -> {final_train:.3f} (mean of the last 20 steps)"),
        ("validation loss", f"{vals[0][1]:.3f} -> {vals[-1][1]:.3f}  (reloaded checkpoint: {reloaded:.3f})"),
        ("throughput", f"{tokens_per_s:,.0f} tokens/s"),
        ("time", f"{busy:.1f} s training, {wall:.1f} s in all"),
    ]
    summary: dict[str, Any] = {
        "mode": "single" if args.single else "pipeline",
        "parameters": parameters,
        "first_loss": losses[0][1],
        "final_train_loss": final_train,
        "first_val_loss": vals[0][1],
        "final_val_loss": vals[-1][1],
        "reloaded_val_loss": reloaded,
        "tokens_per_s": tokens_per_s,
        "train_seconds": busy,
        "wall_seconds": wall,
    }
    if timelines:
        costs = measured_costs(timelines[1:] or timelines, runner.schedule.num_stages)
        simulated = write_timelines(typical(timelines), runner.schedule, costs, out)
        measured = statistics.fmean(t.bubble_ratio for t in timelines)
        rows.append(("bubble", f"{measured:.1%} measured, {simulated.bubble_ratio:.1%} simulated"))
        summary.update(bubble_measured=measured, bubble_simulated=simulated.bubble_ratio)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    rows.append(("outputs", str(out)))
    if not args.single:
        rows.append(("compare with", f"python examples/gpt_stdlib.py --single --steps {args.steps} --out {out}-single"))
    summary_table("stagewise: GPT on the Python standard library", rows)
    if args.sample > 0:
        text = generate(model, b"def ", args.sample, cfg.seq_len, seed=args.seed)
        console.print("[bold]sample from the checkpoint[/bold] (prompt 'def '):")
        console.print("def " + text.decode("utf-8", errors="replace"), markup=False)


def _plural(n: int, one: str, many: str | None = None) -> str:
    return f"{n} {one if n == 1 else many or one + 's'}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    started = time.perf_counter()
    cfg = GPTConfig(seq_len=args.seq_len, d_model=args.d_model, n_heads=args.heads, n_layers=args.layers)
    corpus = stdlib_corpus()
    train_data, valid_data = split(corpus)
    valid = eval_batches(valid_data, args.batch_size, args.seq_len, args.eval_batches)
    layers = gpt_layers(cfg)
    runner = SingleProcess(layers, args) if args.single else Pipelined(layers, args)
    if runner.reports:
        args.out.mkdir(parents=True, exist_ok=True)
        py = f"{sys.version_info.major}.{sys.version_info.minor}"
        console.print(
            f"[bold]stagewise[/bold]: a {cfg.n_layers}-block GPT on {len(corpus):,} bytes of Python {py}'s "
            f"standard library ({len(STDLIB_FILES)} files); {runner.describe()}"
        )
    start = resume(runner, args, cfg)
    metrics, timelines, busy, last = train(runner, args, cfg, train_data, valid, start)
    if runner.reports and last < args.steps:
        console.print(f"stopped after step {last} (--stop-at); run again without it to resume from the checkpoint")
    elif runner.reports and metrics is not None and metrics.series("loss"):
        report(runner, args, cfg, metrics, timelines, busy, time.perf_counter() - started, valid)
    runner.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
