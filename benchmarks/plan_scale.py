"""Planner search cost at scale: 128 transformer blocks (+ embedding and head) on 4,096 processes over 512 nodes.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/plan_scale.py

Prints the search size (layouts, candidates, simulated, pruned, dropped) and
the wall time; the target is < 30 s. Results go to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import os
import time

from stagewise.plan import Link, search
from stagewise.profile_data import LayerCost, LayerProfile

GIB = 2**30


def transformer_profile(blocks: int = 128, d: int = 8192, seq: int = 4096, vocab: int = 128_000) -> LayerProfile:
    """A GPT-like profile for one sample (bf16): blocks alike; the embedding cheap but big, the head costly.

    Times follow 2 x FLOPs / (400 TFLOP/s): a block is 24 s d^2 + 4 s^2 d FLOPs forward, the head 2 s d vocab.
    """
    rate = 400e12
    block_f = (24 * seq * d * d + 4 * seq * seq * d) / rate
    head_f = 2 * seq * d * vocab / rate
    act = 34 * seq * d + 5 * 64 * seq * seq  # bytes per sample (Korthikanti et al. 2022, no recompute, 64 heads)
    hidden = 2 * seq * d
    layers = [LayerCost("embed", 1e-4, 0.0, 1e-4, 1e-4, hidden, 0.0, 2 * vocab * d, hidden)]
    layers += [
        LayerCost(f"block{k}", block_f, block_f, block_f, 2 * block_f, act, act / 3, 2 * 12 * d * d, hidden)
        for k in range(blocks)
    ]
    layers.append(LayerCost("head", head_f, head_f, head_f, 2 * head_f, 2 * seq * vocab, hidden, 2 * vocab * d, 4))
    return LayerProfile(tuple(layers), "synthetic", 1, 0)


def main() -> None:
    profile = transformer_profile()
    started = time.perf_counter()
    result = search(
        profile,
        4096,
        nodes=512,
        global_batch=2048,
        memory=80 * GIB,
        intra=Link(5e-6, 300e9),
        inter=Link(2e-5, 25e9),
        tp_layers=range(1, 129),
        top=5,
    )
    elapsed = time.perf_counter() - started
    print(f"load average {os.getloadavg()[0]:.2f}")
    print(
        f"layouts {result.layouts}, candidates {result.candidates}, simulated {result.simulated}, "
        f"pruned by the bound {result.pruned}, dropped {len(result.dropped)}"
    )
    print(f"search time {elapsed:.1f} s (target < 30 s)")
    for k, p in enumerate(result.plans, 1):
        print(f"{k}. {p.describe()}: {p.step_time:.3f} s, bubble {p.bubble:.1%}, peak {p.peak_memory / GIB:.1f} GiB")
        print(f"   {p.why}")


if __name__ == "__main__":
    main()
