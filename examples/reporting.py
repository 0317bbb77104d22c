"""What the example scripts show and write: a live progress bar, a CSV of both modes, timelines, a summary.

Nothing here trains; the scripts call these helpers around their loops. Only
the rank that reports (the one holding the last stage, which computes the loss)
draws the progress bar and writes files. What the library does itself is not
here: the per-step metrics (``Pipeline(metrics=DIR)``: JSON lines and
TensorBoard), the loss plot and the gathered state dict
(``stagewise.runtime.plot_losses``, ``gather_state_dict``).
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
    """Per-step metrics to ``metrics.csv`` (both modes; the pipeline writes its own too: ``metrics=``).

    ``start``: the step a resumed run goes on from: the rows the earlier run wrote up to it are kept (the file
    and the loss curve tell the whole run), those after it dropped (those steps are trained again); a row logged
    again for a step (the resumed run's validation at ``start``) adds to it."""

    FIELDS = ("step", "loss", "lr", "rate", "bubble", "val_loss", "time")

    def __init__(self, out: Path, start: int = 0) -> None:
        self.rows: list[dict[str, Any]] = []
        self.path = out / "metrics.csv"
        self._started = time.perf_counter()
        if start > 0 and self.path.exists():
            with self.path.open(newline="") as f:
                earlier = [{k: _number(v) for k, v in row.items()} for row in csv.DictReader(f)]
            self.rows = [r for r in earlier if r.get("step") is not None and r["step"] <= start]

    def log(self, step: int, **values: float | None) -> None:
        if self.rows and self.rows[-1]["step"] == step:
            self.rows[-1].update({k: v for k, v in values.items() if v is not None})
            return
        self.rows.append({"step": step, "time": round(time.perf_counter() - self._started, 3), **values})

    def series(self, key: str) -> list[tuple[int, float]]:
        return [(r["step"], r[key]) for r in self.rows if r.get(key) is not None]

    def close(self) -> None:
        with self.path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=self.FIELDS, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(self.rows)


def _number(text: str | None) -> float | int | None:
    """A CSV cell as it was logged: an int (the step), a float, or None (an empty cell)."""
    if text is None or text == "":
        return None
    value = float(text)
    return int(value) if value.is_integer() and "." not in text else value


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


# ---- summary -----------------------------------------------------------------------------------


def summary_table(title: str, rows: Sequence[tuple[str, str]]) -> None:
    table = Table(title=title, show_header=False, title_style="bold", min_width=50)
    table.add_column(style="cyan", no_wrap=True)
    table.add_column()
    for key, value in rows:
        table.add_row(key, value)
    console.print(table)
