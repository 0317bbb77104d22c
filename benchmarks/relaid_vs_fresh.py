"""Whether a re-laid-out pipeline steps as fast as a fresh one of its cut.

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.relaid_vs_fresh [--moves 2] [--rounds 30] [--share 0.5]

Two ranks of one thread train the demo GPT (``gpt64``, 10 layers, 1F1B, 8 micro-batches). The live pipeline is
re-laid out ``--moves`` times (an uneven cut and back to the even one), then it and two fresh pipelines built with
the even cut (A and B: B is the control, the noise between two pipelines that differ in nothing) are timed in
rounds, one step each, in turn (each round starting one later). ``--share``: rank 1 held to that share of a core
(cgroup v1, as ``benchmarks.stragglers``) for the timed rounds. Prints per-round ratios' medians and quartiles:
live / A against B / A.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any

from ._launch import run_as_rank, timed_step


def rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import stagewise as sw

    from .fidelity.workloads import workloads
    from .stragglers import Throttle

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    work = workloads()["gpt64"]
    x, y = work.data(work.microbatch * 8)

    def pipe(partition: Any) -> Any:
        return sw.Pipeline(
            work.layers(), loss_fn=work.loss, schedule="1f1b", microbatches=8, partition=partition, seed=0
        )

    even = [5, 5]
    live = pipe(even)
    for _ in range(2):
        timed_step(live, x, y)
    for m in range(args.moves):
        live.relayout(partition=[7, 3] if m % 2 == 0 else even)
        for _ in range(2):
            timed_step(live, x, y)
    if [len(r) for r in live.layer_ranges] != even:
        live.relayout(partition=even)
    pipes = {"live": live, "A": pipe(even), "B": pipe(even)}
    throttle = Throttle(False, rank, None) if args.share else None
    if throttle:
        throttle.set(args.share)
    try:
        names = list(pipes)
        times: dict[str, list[float]] = {n: [] for n in names}
        if args.block:  # each pipeline's steps in a row, blocks in turn (the live phases of benchmarks.stragglers)
            for b in range(args.rounds // args.block + 1):
                for n in names[b % 3 :] + names[: b % 3]:
                    for k in range(args.block + 1):
                        took = timed_step(pipes[n], x, y)
                        if b and k:
                            times[n].append(took)
        else:
            for r in range(args.rounds + 1):
                for n in names[r % 3 :] + names[: r % 3]:
                    took = timed_step(pipes[n], x, y)
                    if r:
                        times[n].append(took)
    finally:
        if throttle:
            throttle.close()
    if rank == 0:

        def q(v: list[float]) -> str:
            a, b, c = statistics.quantiles(v, n=4)
            return f"{b:.3f} [{a:.3f}, {c:.3f}]"

        for n in names:
            print(f"{n}: median {statistics.median(times[n]) * 1e3:.1f} ms")
        print("live/A", q([lv / a for lv, a in zip(times["live"], times["A"])]))
        print("B/A   ", q([b / a for b, a in zip(times["B"], times["A"])]))
        print(
            "medians live/A",
            statistics.median(times["live"]) / statistics.median(times["A"]),
            "B/A",
            statistics.median(times["B"]) / statistics.median(times["A"]),
        )
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--moves", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--share", type=float, default=0.0)
    parser.add_argument("--block", type=int, default=0, help="steps in a row per pipeline (0: one each, in rounds)")
    return run_as_rank(2, "benchmarks.relaid_vs_fresh", rank_main, parser.parse_args(argv), argv, OMP_NUM_THREADS="1")


if __name__ == "__main__":
    sys.exit(main())
