"""What a read of the device per micro-batch costs a step: token counts kept on the device against counts read.

    .venv/bin/python -m benchmarks.host_reads                  # CPU, 1 rank, 4 stages on it
    .venv/bin/python -m benchmarks.host_reads --device cuda    # where a read stops the host until the GPU is done

One process, a 1-rank pipeline of 4 virtual stages (interleaved 1F1B) of a small transformer, SGD, ``m``
micro-batches per step. Variants, every one ``nan_policy=None`` unless named:

* *counts on the device*: ``loss_weights`` returns a tensor; the runtime keeps it there (no read per
  micro-batch; the step reads the device once, for its loss);
* *counts read*: ``loss_weights`` returns ``int(...)`` (as ``sw.count_tokens`` does): one read per
  micro-batch, in the user's function;
* *rows*: no ``loss_weights`` (each micro-batch weighted by its rows: nothing to count);
* *counts on the device, nan_policy="raise"*: the non-finite check's read and its work on top.

Each variant runs ``--warmup`` steps, then ``--steps`` timed ones, in turns (every variant once per round) so that
a load that comes and goes weighs on all alike; the median step and the ratio to the first variant.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import stagewise as sw

from .gpu_check.common import Sizes, lm_data, lm_layers, lm_loss, synchronize


def on_device(labels: torch.Tensor) -> torch.Tensor:
    return (labels != -100).sum()


def read(labels: torch.Tensor) -> int:
    return int((labels != -100).sum())


VARIANTS: dict[str, tuple[Any, str | None]] = {
    "counts on the device": (on_device, None),
    "counts read (int)": (read, None),
    "rows": (None, None),
    'counts on the device, nan_policy="raise"': (on_device, "raise"),
}


def step_of(sizes: Sizes, device: torch.device, m: int, loss_weights: Any, policy: str | None) -> Callable[[], None]:
    pipe = sw.Pipeline(lm_layers(sizes, torch.float32), loss_fn=lm_loss, schedule="interleaved-1f1b",
                       virtual_stages=4, microbatches=m, loss_weights=loss_weights, nan_policy=policy, device=device,
                       optimizer=lambda ps: torch.optim.SGD(ps, lr=0.01), seed=0)  # fmt: skip
    x, y = lm_data(sizes, 0, device)
    return lambda: pipe.train_step(x, y) and None


def measure(args: argparse.Namespace, device: torch.device, m: int) -> dict[str, float]:
    sizes = Sizes(args.d_model, 4, args.seq, args.batch, m, {}, 0, 0, 0)
    steps = {name: step_of(sizes, device, m, lw, policy) for name, (lw, policy) in VARIANTS.items()}
    for step in steps.values():
        for _ in range(args.warmup):
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.steps):
        for name, step in steps.items():
            synchronize(device)
            t = time.perf_counter()
            step()
            synchronize(device)
            times[name].append(time.perf_counter() - t)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--microbatches", type=int, nargs="+", default=[4, 16])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args()
    env = sw.init(backend="nccl" if args.device == "cuda" else "gloo")
    print(f"1 rank x 4 stages, batch {args.batch} x {args.seq} tokens, d_model {args.d_model}, {env.device}, "
          f"{torch.get_num_threads()} threads; median of {args.steps} steps")  # fmt: skip
    print("| m | variant | step (ms) | vs counts on the device |\n|---:|---|---:|---:|")
    for m in args.microbatches:
        found = measure(args, env.device, m)
        base = found["counts on the device"]
        for name, sec in found.items():
            print(f"| {m} | {name} | {sec * 1e3:.2f} | {sec / base:.3f} |")


if __name__ == "__main__":
    main()
