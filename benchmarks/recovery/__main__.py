"""Recovery of an elastic job: what a lost machine costs, what snapshots cost a step, and ten minutes of chaos.

    sudo .venv/bin/python -m benchmarks.recovery faults --trials 20      # kill / partition / stop + return
    .venv/bin/python -m benchmarks.recovery snapshots                     # snapshot=1 against none, A/B
    sudo .venv/bin/python -m benchmarks.recovery chaos --duration 600     # `make chaos`

``faults`` and ``chaos`` run 3 machines of 2 processes, each a network namespace with its own memory file
system, under the command docs/guides/elastic.md shows (tests/system/scripts/chaos_harness.py); they need
root (``ip netns``). ``snapshots`` runs on this machine's processes. Every table is printed with the load
average it was taken under. See docs/benchmarks/recovery.md.
"""

from __future__ import annotations

import argparse
import sys

from .._launch import with_the_tests
from . import chaos, chaos_cpu, cutoff, faults, snapshots


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.recovery", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    faults.add(sub)
    snapshots.add(sub)
    chaos.add(sub)
    cutoff.add(sub)
    chaos_cpu.add(sub)
    args = p.parse_args()
    if args.what == "snapshots":
        return snapshots.main(args)
    with_the_tests("benchmarks.recovery", "chaos_harness")
    if args.what == "faults":
        print(faults.table(faults.run(args), args.cases))
        return 0
    if args.what == "cutoff":
        return cutoff.main(args)
    if args.what == "chaos-cpu":
        return chaos_cpu.main(args)
    return chaos.main(args)


if __name__ == "__main__":
    sys.exit(main())
