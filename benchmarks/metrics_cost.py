"""What ``metrics=`` costs a train step (issue 50): the reporting part's own time, and the step's, with and without.

    .venv/bin/python -m benchmarks.metrics_cost [--blocks 8] [--width 64] [--rows 32] [--steps 60]

One process, one rank, the model cut into 2 stages (``interleaved-1f1b``, 4 micro-batches, ``optimizer=`` SGD),
float32, one thread. Four settings: no metrics and no progress line; ``metrics=DIR`` with the JSON lines alone
(``tensorboard=False``); with TensorBoard's event files too (when installed); and the progress line logged at
INFO (to a null handler). For each, the median step time (ms) and the reporting part's own time per step (µs:
its ``around`` and ``after``, timed around each call), which is what it adds: it issues no collective.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import stagewise as sw
from stagewise.runtime import MetricsConfig

#: the progress line's logger (stagewise.runtime.reporting.progress), set to INFO below
PROGRESS = "stagewise.runtime.reporting.progress"


def tensorboard_installed() -> bool:
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        return False
    return True


def timed(part: Any) -> list[float]:
    """Time each call of the pipeline's reporting part (``pipe.metrics``, the step part the runner calls): its
    instance's ``around`` and ``after`` replaced by timed wrappers; the seconds of each step, appended."""
    own = [0.0]
    around, after = part.around, part.after

    @contextmanager
    def timed_around(run: Any) -> Iterator[None]:
        t = time.perf_counter()
        with around(run):
            own[-1] += time.perf_counter() - t
            yield

    def timed_after(run: Any) -> None:
        t = time.perf_counter()
        after(run)
        own[-1] += time.perf_counter() - t
        own.append(0.0)

    part.around, part.after = timed_around, timed_after
    return own


def measure(setting: str, folder: Path, args: argparse.Namespace) -> tuple[float, float]:
    """(median step ms, median reporting µs per step) of ``setting``."""
    layers = [sw.Layer(nn.Linear, args.width, args.width) for _ in range(args.blocks)] + [
        sw.Layer(nn.Linear, args.width, 10)
    ]
    metrics: Any = None
    if setting == "json":
        metrics = MetricsConfig(folder / setting, tensorboard=False)
    elif setting == "tensorboard":
        metrics = folder / setting
    pipe = sw.Pipeline(
        layers, loss_fn=F.cross_entropy, schedule="interleaved-1f1b", virtual_stages=2, microbatches=4,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.01), metrics=metrics, progress=setting == "progress",
    )  # fmt: skip
    own = timed(pipe.metrics)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(args.rows, args.width, generator=g), torch.randint(0, 10, (args.rows,), generator=g)
    times = []
    for _ in range(args.steps + 5):
        t = time.perf_counter()
        pipe.train_step(x, y)
        times.append(time.perf_counter() - t)
    pipe.metrics.close()
    return statistics.median(times[5:]) * 1e3, statistics.median(own[5:-1]) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    torch.set_num_threads(1)
    sw.init(backend="gloo")
    progress_log = logging.getLogger(PROGRESS)
    progress_log.addHandler(logging.NullHandler())
    progress_log.propagate = False
    progress_log.setLevel(logging.INFO)
    settings = ["off", "json", *(["tensorboard"] if tensorboard_installed() else []), "progress", "off again"]
    with tempfile.TemporaryDirectory() as tmp:
        rows = {s: measure(s, Path(tmp), args) for s in settings}
    base = rows["off"][0]
    print(f"{'setting':<12} {'step (ms)':>10} {'vs off':>8} {'reporting (us/step)':>20}")
    for s, (ms, own) in rows.items():
        print(f"{s:<12} {ms:>10.3f} {ms / base:>8.3f} {own:>20.1f}")


if __name__ == "__main__":
    main()
