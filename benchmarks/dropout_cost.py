"""What seeding each dropout mask costs (issue 42): a train step of a tiny model with and without it.

    .venv/bin/python -m benchmarks.dropout_cost [--blocks 8] [--width 64] [--rows 32] [--steps 30]

One process, one rank, the model cut into 2 stages (``interleaved-1f1b``, 4 micro-batches), float32, one
thread. Three models of ``blocks`` blocks (Linear, tanh, and a dropout of 0.1 after each):

* *no dropout*: the blocks without it (a stage with no module that drops is not touched: no cost);
* *dropout, unseeded*: ``F.dropout`` under an attribute the seeding does not recognise (the global generator,
  as before the seeding existed);
* *dropout, seeded*: ``nn.Dropout`` (each call's generator seeded by (seed, step, micro-batch, module)).

Prints the median step time of each (ms), the seeding's cost per step and per seeded call, and the cost of
one save, seed and restore of the CPU generator alone.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

import stagewise as sw


class Block(nn.Module):
    def __init__(self, width: int, how: str) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.how = how
        self.drop = nn.Dropout(0.1) if how == "seeded" else nn.Identity()
        self.rate = 0.1  # (a name the seeding does not look for)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out = torch.tanh(self.lin(h))
        if self.how == "unseeded":
            out = F.dropout(out, self.rate, self.training)
        return h + self.drop(out)


def step_ms(how: str, blocks: int, width: int, rows: int, steps: int) -> float:
    layers = [sw.Layer(Block, width, how) for _ in range(blocks)] + [sw.Layer(nn.Linear, width, 10)]
    pipe = sw.Pipeline(layers, loss_fn=F.cross_entropy, schedule="interleaved-1f1b", virtual_stages=2, microbatches=4)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(rows, width, generator=g), torch.randint(0, 10, (rows,), generator=g)
    times = []
    for _ in range(steps + 3):
        t = time.perf_counter()
        pipe.train_step(x, y)
        times.append(time.perf_counter() - t)
        pipe.zero_grad(set_to_none=True)
    return statistics.median(times[3:]) * 1e3


def generator_us(repeat: int = 2000) -> float:
    """One save, seed and restore of the CPU generator (what each seeded call adds, hooks aside), in us."""
    gen = torch.default_generator
    t = time.perf_counter()
    for k in range(repeat):
        state = gen.get_state()
        gen.manual_seed(k)
        gen.set_state(state)
    return (time.perf_counter() - t) / repeat * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    sw.init(backend="gloo")
    ms = {how: step_ms(how, args.blocks, args.width, args.rows, args.steps) for how in ("none", "unseeded", "seeded")}
    calls = args.blocks * 4  # seeded calls per step: one per block and micro-batch
    print(f"{args.blocks} blocks of width {args.width}, {args.rows} rows, 4 micro-batches, 2 stages on one rank")
    print("| model | step (ms) |\n|---|---:|")
    for how, label in (("none", "no dropout"), ("unseeded", "dropout, unseeded"), ("seeded", "dropout, seeded")):
        print(f"| {label} | {ms[how]:.2f} |")
    extra = ms["seeded"] - ms["unseeded"]
    print(
        f"seeding: {extra:+.2f} ms a step ({extra / ms['unseeded']:+.0%}), {extra / calls * 1e3:+.1f} us a seeded call"
    )
    print(f"one save + seed + restore of the CPU generator: {generator_us():.1f} us")


if __name__ == "__main__":
    main()
