"""Planner search cost at scale: 128 transformer blocks (+ embedding and head) on 4,096 processes over 512 nodes.

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.plan_scale

Prints the search size (layouts, candidates, simulated, pruned, dropped) and
the wall time; the target is < 30 s. Results go to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import time

from stagewise.planning import Link, search, transformer_profile

GIB = 2**30


def main() -> None:
    argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0]).parse_args()  # no options: --help only
    profile = transformer_profile()
    started, cpu = time.perf_counter(), time.process_time()
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
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    print(f"load average {os.getloadavg()[0]:.2f}")
    print(
        f"layouts {result.layouts}, candidates {result.candidates}, groups expanded {result.groups_expanded}, "
        f"simulated {result.simulated}, dropped {len(result.dropped)}"
    )
    print(f"search time {elapsed:.1f} s wall, {cpu:.1f} s CPU (target < 30 s)")
    for k, p in enumerate(result.plans, 1):
        print(f"{k}. {p.describe()}: {p.step_time:.3f} s, bubble {p.bubble:.1%}, peak {p.peak_memory / GIB:.1f} GiB")
        print(f"   {p.why}")


if __name__ == "__main__":
    main()
