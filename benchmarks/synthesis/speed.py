"""The synthesized schedule against the best hand-written one, measured at 2 ranks on a GPT with uneven stages.

    .venv/bin/python -m benchmarks.synthesis.speed [--rounds 40] [--microbatches 4] [--partition 6 10]

Starts 2 gloo ranks (torchrun) on this machine. Rank 0 profiles the demo GPT's layers (12 blocks; one
micro-batch of 4 sequences) and sends the profile to rank 1; both cut it into two uneven stages
(``--partition``: layers per stage), synthesize a schedule for those costs under twice 1F1B's memory
(deterministic, so both ranks get the same) and build two pipelines of the same model: the best
registered schedule that fits the same cap (the synthesis report's baseline) and the synthesized one.
Then ``--rounds`` rounds of one training step of each, alternating which goes first, each step between
two barriers; the ratio is taken per round and its median printed, with the simulator's prediction.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from .._launch import launched, on_ranks


def run(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import stagewise as sw
    from stagewise.partition import LayerProfile
    from stagewise.simulation import simulate
    from stagewise.synthesis import report_of, synthesize

    from .._examples import example
    from .measure import gpt_profile

    torch.set_num_threads(1)
    sw.init(backend="gloo")
    rank = dist.get_rank()
    gm = example("gpt_model")
    cfg = gm.GPTConfig(n_layers=12)
    box = [gpt_profile(rounds=3).to_json() if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    prof = LayerProfile.from_json(str(box[0]))
    bounds = [0]
    for c in args.partition:
        bounds.append(bounds[-1] + c)
    costs = prof.cost_model(bounds)
    m = args.microbatches
    auto = synthesize(costs, 2, m, memory=2 * min(2, m))
    rep = report_of(auto)
    layers = gm.gpt_layers(cfg)
    pipes = {
        name: sw.Pipeline(layers, loss_fn=gm.lm_loss, schedule=sched, microbatches=m, partition=list(args.partition))
        for name, sched in ((rep.baseline, rep.baseline), ("synthesized", auto))
    }
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (4 * m, cfg.seq_len + 1), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    times: dict[str, list[float]] = {name: [] for name in pipes}
    order = list(pipes)
    for k in range(args.rounds + 3):
        for name in order if k % 2 == 0 else order[::-1]:
            dist.barrier()
            start = time.perf_counter()
            pipes[name].train_step(x, y)
            dist.barrier()
            if k >= 3:  # the first rounds warm up
                times[name].append(time.perf_counter() - start)
            pipes[name].zero_grad(set_to_none=True)
    if rank == 0:
        ratios = [b / a for a, b in zip(times[rep.baseline], times["synthesized"])]
        sim = {n: simulate(sw.build_schedule(n, 2, m) if n != "synthesized" else auto, costs).makespan for n in pipes}
        work = zip(costs.forward, costs.backward_input, costs.backward_weight)
        print(f"profile: stage F+I+W (ms) {[round(1e3 * (f + i + w), 2) for f, i, w in work]}")
        print("| schedule | simulated ms | measured step ms (median) |\n|---|---:|---:|")
        for name in pipes:
            print(f"| {name} | {1e3 * sim[name]:.2f} | {1e3 * statistics.median(times[name]):.2f} |")
        print(
            f"\nsynthesized / {rep.baseline}: median {statistics.median(ratios):.3f} over {len(ratios)} rounds "
            f"(quartiles {statistics.quantiles(ratios, n=4)[0]:.3f} .. {statistics.quantiles(ratios, n=4)[2]:.3f}); "
            f"simulated {sim['synthesized'] / sim[rep.baseline]:.3f}"
        )
        print(f"load average after: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--partition", type=int, nargs=2, default=[6, 10], help="layers per stage (16 in all)")
    args = parser.parse_args()
    if launched():
        run(args)
        return
    print(f"load average before: {' '.join(f'{v:.2f}' for v in os.getloadavg())}", flush=True)
    sys.exit(on_ranks(2, "benchmarks.synthesis.speed", sys.argv[1:], OMP_NUM_THREADS="1"))


if __name__ == "__main__":
    main()
