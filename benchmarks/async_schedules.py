"""Asynchronous schedules next to 1F1B on the same processes: time per mini-batch, measured and simulated.

    .venv/bin/python -m benchmarks.async_schedules
    .venv/bin/python -m benchmarks.async_schedules --ranks 4 --minibatches 24 --window 8

Every variant trains the same float32 MLP on the same mini-batches of m
micro-batches: ``1f1b`` with ``train_step`` (a flush per mini-batch, the
optimizer at its STEPs), the asynchronous ones with ``train_stream`` in
windows of ``--window`` mini-batches. After one warm-up window, the timed
mini-batches run between two barriers, in ``--rounds`` rounds that interleave
the variants; *ms / mini-batch* is the median over the rounds of the slowest
rank's wall time over the mini-batch count. *sim* is the simulator's time per mini-batch with
F = 1, B = 2 (free transfers) relative to 1F1B's, *measured* the same ratio
as measured: what the bubble saves, minus what weight snapshots and
functional calls cost. Rank 0 prints the table. Run as a module, it starts
``--ranks`` local ranks (torchrun) running itself.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import stagewise as sw
from stagewise.passes import lower
from stagewise.schedules import async_schedule

from ._launch import launched, on_ranks

LAYERS, CLASSES = 12, 10


def layers(d: int) -> list[sw.Layer]:
    out: list[sw.Layer] = []
    for k in range(LAYERS - 1):
        out.append(sw.Layer(nn.Linear, d, d) if k % 2 == 0 else sw.Layer(nn.GELU))
    return out + [sw.Layer(nn.Linear, d, CLASSES)]


def variants(p: int, window: int, m: int) -> list[tuple[str, Any, str]]:
    return [
        ("1f1b", sw.build_schedule("1f1b", p, m), "sgd"),
        ("pipedream", async_schedule("pipedream", p, window, m), "sgd"),
        ("pipedream nostash", async_schedule("pipedream", p, window, m, stashing=False), "sgd"),
        ("pipedream vsync", async_schedule("pipedream", p, window, m, vertical_sync=True), "sgd"),
        ("pipedream-2bw", async_schedule("pipedream-2bw", p, window, m), "sgd"),
        ("xpipe", async_schedule("xpipe", p, window, m), "momentum"),
    ]


def sim_per_minibatch(schedule: sw.Schedule, m: int) -> float:
    costs = sw.CostModel.uniform(schedule.num_stages, forward=1, backward_input=1, backward_weight=1)
    result = sw.simulate(lower(schedule) if not schedule.is_complete else schedule, costs)
    return result.makespan / (schedule.num_microbatches // m)


def run(pipe: sw.Pipeline, label: str, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    if label == "1f1b":
        for x, y in batches:
            pipe.train_step(x, y)
    else:
        list(pipe.train_stream(batches))


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2, help="ranks to start when run as a module (default 2)")
    parser.add_argument("--minibatches", type=int, default=16, help="timed mini-batches per variant")
    parser.add_argument("--window", type=int, default=8, help="mini-batches per asynchronous window")
    parser.add_argument("--microbatches", type=int, default=4, help="micro-batches per mini-batch")
    parser.add_argument("--batch", type=int, default=64, help="samples per mini-batch")
    parser.add_argument("--width", type=int, default=256, help="hidden size of the MLP")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per variant (the median is shown)")
    args = parser.parse_args()
    if not launched():  # python -m benchmarks.async_schedules: start the ranks, each running this module
        sys.exit(on_ranks(args.ranks, "benchmarks.async_schedules", sys.argv[1:]))
    torch.set_num_threads(1)
    env = sw.init(backend="gloo")
    p, m = env.world_size, args.microbatches
    g = torch.Generator().manual_seed(0)
    data = [
        (torch.randn(args.batch, args.width, generator=g), torch.randint(0, CLASSES, (args.batch,), generator=g))
        for _ in range(args.window + args.minibatches)
    ]
    pipes = []
    for label, schedule, opt in variants(p, args.window, m):

        def factory(params: list[nn.Parameter], opt: str = opt) -> torch.optim.Optimizer:
            return torch.optim.SGD(params, lr=0.01, momentum=0.9 if opt == "momentum" else 0.0)

        pipe = sw.Pipeline(layers(args.width), loss_fn=F.cross_entropy, schedule=schedule, optimizer=factory)
        run(pipe, label, data[: args.window])  # warm-up: shapes, buffers
        pipes.append((label, schedule, pipe))
    times: dict[str, list[float]] = {label: [] for label, _, _ in pipes}
    for _ in range(args.rounds):  # rounds interleave the variants, so a burst of load hits them alike
        for label, _, pipe in pipes:
            dist.barrier()
            t0 = time.perf_counter()
            run(pipe, label, data[args.window :])
            elapsed = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times[label].append(1000 * elapsed.item() / args.minibatches)
    rows = [(label, statistics.median(times[label]), sim_per_minibatch(sched, m)) for label, sched, _ in pipes]
    if env.rank == 0:
        base_ms, base_sim = rows[0][1], rows[0][2]
        print(
            f"p={p} m={m} window={args.window} batch={args.batch} timed={args.minibatches} x {args.rounds} rounds "
            f"width={args.width} layers={LAYERS}"
        )
        print("| schedule | ms / mini-batch | measured vs 1f1b | sim vs 1f1b |")
        print("|---|---:|---:|---:|")
        for label, ms, sim in rows:
            print(f"| {label} | {ms:.1f} | {ms / base_ms:.2f} | {sim / base_sim:.2f} |")


if __name__ == "__main__":
    main()
