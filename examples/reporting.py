"""What the example scripts show and write: live progress, metrics, timelines, loss curve, checkpoint, summary.

Nothing here trains; the scripts call these helpers around their loops. Only
the rank that reports (the one holding the last stage, which computes the loss)
draws the progress bar and writes files; :func:`gather_state_dict` is the one
collective, and every rank calls it.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

import stagewise as sw
from stagewise.ir import Kind

console = Console(highlight=False)


# ---- live progress and metrics ---------------------------------------------------------------


class TrainingProgress:
    """A rich progress bar (step, loss, throughput, measured bubble, ETA); plain lines when not on a terminal."""

    def __init__(self, total: int, *, unit: str, enabled: bool, log_every: int = 25) -> None:
        self.total, self.unit, self.enabled, self.log_every = total, unit, enabled, max(1, log_every)
        self.live = enabled and console.is_terminal
        self._bar: Progress | None = None
        if self.live:
            self._bar = Progress(
                TextColumn("[bold blue]train"),
                BarColumn(bar_width=30),
                MofNCompleteColumn(),
                TextColumn("loss [bold]{task.fields[loss]}"),
                TextColumn("{task.fields[rate]}"),
                TextColumn("bubble {task.fields[bubble]}"),
                TimeElapsedColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                console=console,
            )
            self._task = self._bar.add_task("train", total=total, loss="-", rate="-", bubble="-")
            self._bar.start()

    def update(self, step: int, loss: float, rate: float, bubble: float | None) -> None:
        """Report that ``step`` (1-based) is done."""
        if not self.enabled:
            return
        shown = {"loss": f"{loss:.3f}", "rate": f"{rate:,.0f} {self.unit}", "bubble": _pct(bubble)}
        if self._bar is not None:
            self._bar.update(self._task, completed=step, **shown)
        elif step % self.log_every == 0 or step == self.total:
            console.print(f"step {step}/{self.total}  loss {shown['loss']}  {shown['rate']}  bubble {shown['bubble']}")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


class MetricsLog:
    """Per-step metrics to ``metrics.csv``, and to TensorBoard (``tb/``) when asked and importable."""

    FIELDS = ("step", "loss", "lr", "rate", "bubble", "val_loss", "time")

    def __init__(self, out: Path, *, tensorboard: bool) -> None:
        self.rows: list[dict[str, Any]] = []
        self.path = out / "metrics.csv"
        self._writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # checked by tensorboard_available()

            self._writer = SummaryWriter(str(out / "tb"))
        self._started = time.perf_counter()

    def log(self, step: int, **values: float | None) -> None:
        row = {"step": step, "time": round(time.perf_counter() - self._started, 3), **values}
        self.rows.append(row)
        if self._writer is not None:
            for key, value in values.items():
                if value is not None:
                    self._writer.add_scalar(key, value, step)

    def series(self, key: str) -> list[tuple[int, float]]:
        return [(r["step"], r[key]) for r in self.rows if r.get(key) is not None]

    def close(self) -> None:
        with self.path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=self.FIELDS, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(self.rows)
        if self._writer is not None:
            self._writer.close()


def tensorboard_available() -> bool:
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:
        return False
    return True


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


# ---- timelines: measured vs simulated ---------------------------------------------------------


def measured_costs(timelines: Sequence[sw.Timeline], num_stages: int) -> sw.CostModel:
    """Per-stage compute times and the transfer latency, measured over the given steps, as a cost model.

    Times are means over the steps; a stage that ran a full backward B gets
    I = B and W = 0 (the simulator charges B as I + W), one that ran split I
    and W gets their means. The latency is :func:`measured_latency`.
    """
    durations: dict[tuple[int, Kind], list[float]] = {}
    for timeline in timelines:
        for e in timeline.events:
            durations.setdefault((e.action.stage, e.action.kind), []).append(e.duration)

    def mean(stage: int, kind: Kind) -> float:
        values = durations.get((stage, kind))
        return statistics.fmean(values) if values else 0.0

    def per_stage(kind: Kind) -> tuple[float, ...]:
        return tuple(mean(s, kind) for s in range(num_stages))

    split = [(s, Kind.I) in durations for s in range(num_stages)]
    full = per_stage(Kind.B)
    zeros = (0.0,) * num_stages
    return sw.CostModel(
        num_stages=num_stages,
        forward=per_stage(Kind.F),
        backward_input=tuple(mean(s, Kind.I) if split[s] else full[s] for s in range(num_stages)),
        backward_weight=tuple(mean(s, Kind.W) if split[s] else 0.0 for s in range(num_stages)),
        activation_bytes=zeros,
        weight_activation_bytes=zeros,
        parameter_bytes=zeros,
        output_bytes=zeros,
        latency=measured_latency(timelines),
        sync_time=per_stage(Kind.SYNC),
        step_time=per_stage(Kind.STEP),
    )


def measured_latency(timelines: Sequence[sw.Timeline]) -> float:
    """The median time from a value's making on one rank to the start of its use on another, for waiting users.

    Only uses where the receiving rank sat idle waiting are counted (its
    previous compute ended before the value was made), so the gap is transfer
    and wake-up time, not the receiver's own work. It includes the operating
    system's scheduling delays, which dominate when ranks outnumber cores.
    """
    gaps = []
    for timeline in timelines:
        compute = [e for e in timeline.events if e.action.kind.is_compute]
        made = {(e.action.stage, e.action.kind.value, e.action.microbatch): e for e in compute}
        for row in timeline.by_rank():
            previous_end = None
            for e in (e for e in row if e.action.kind.is_compute):
                a = e.action
                if a.kind is Kind.F:
                    source = made.get((a.stage - 1, "F", a.microbatch))
                elif a.kind in (Kind.B, Kind.I):
                    source = made.get((a.stage + 1, "B", a.microbatch)) or made.get((a.stage + 1, "I", a.microbatch))
                else:
                    source = None
                if (
                    source is not None
                    and source.rank != e.rank
                    and (previous_end is None or previous_end <= source.end)
                ):
                    gaps.append(max(0.0, e.start - source.end))
                previous_end = e.end
    return statistics.median(gaps) if gaps else 0.0


def typical(timelines: Sequence[sw.Timeline]) -> sw.Timeline:
    """The step with the median makespan: a representative picture, not the luckiest or the slowest."""
    ordered = sorted(timelines, key=lambda t: t.makespan)
    return ordered[len(ordered) // 2]


def write_timelines(measured: sw.Timeline, schedule: sw.Schedule, costs: sw.CostModel, out: Path) -> sw.Timeline:
    """Draw one measured step next to the simulator's prediction from the same per-stage costs.

    Writes ``timeline_measured.{png,trace.json}``, ``timeline_simulated.{png,trace.json}``
    and ``timeline_compare.png`` (the two charts stacked on one time scale);
    returns the simulated timeline (in seconds).
    """
    simulated = dataclasses.replace(sw.simulate(schedule, costs).timeline, unit="s")
    what = f"{schedule.name}, {schedule.num_ranks} ranks, {schedule.num_microbatches} micro-batches"
    how = f"from the measured compute times and a {costs.latency * 1e3:.2f} ms transfer latency"
    titles = [f"measured: {what}", f"simulated {how}: {what}"]
    for timeline, label, title in zip((measured, simulated), ("measured", "simulated"), titles):
        sw.render_png(timeline, out / f"timeline_{label}.png", title=title)
        sw.render_trace(timeline, out / f"timeline_{label}.trace.json")
    sw.render.render_stack([measured, simulated], out / "timeline_compare.png", titles=titles)  # one time scale
    (out / "costs.json").write_text(json.dumps(costs.to_dict(), indent=1))
    return simulated


# ---- loss curve, checkpoint, summary ----------------------------------------------------------


def plot_losses(train: Sequence[tuple[int, float]], valid: Sequence[tuple[int, float]], path: Path, title: str) -> Path:
    """Training loss per step (and a moving average) with validation points, as a PNG."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4.5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    if train:
        steps, losses = zip(*train)
        ax.plot(steps, losses, color="#4E79A7", alpha=0.35, linewidth=0.8, label="train (per step)")
        h = max(1, len(losses) // 50)  # a centred window of 2h + 1 steps
        smooth = [statistics.fmean(losses[max(0, i - h) : i + h + 1]) for i in range(len(losses))]
        ax.plot(steps, smooth, color="#4E79A7", linewidth=1.8, label=f"train (mean of {2 * h + 1} steps)")
    if valid:
        steps, losses = zip(*valid)
        ax.plot(steps, losses, "o-", color="#E15759", linewidth=1.5, markersize=4, label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per token)")
    ax.set_title(title, fontsize=11)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    return path


def gather_state_dict(module: torch.nn.Module, dst: int) -> dict[str, torch.Tensor] | None:
    """Every rank's share of the model (original parameter names) merged on rank ``dst``; None elsewhere.

    A collective: call it on every rank. Without a process group (one process) it is ``state_dict()``.
    """
    mine = {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return mine
    parts: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == dst else []
    dist.gather_object(mine, parts if dist.get_rank() == dst else None, dst=dst)
    if dist.get_rank() != dst:
        return None
    merged: dict[str, torch.Tensor] = {}
    for part in parts:
        clash = merged.keys() & part.keys()
        if clash:
            raise ValueError(f"two ranks hold the same parameters: {sorted(clash)[:3]}")
        merged.update(part)
    return merged


def summary_table(title: str, rows: Sequence[tuple[str, str]]) -> None:
    table = Table(title=title, show_header=False, title_style="bold", min_width=50)
    table.add_column(style="cyan", no_wrap=True)
    table.add_column()
    for key, value in rows:
        table.add_row(key, value)
    console.print(table)
