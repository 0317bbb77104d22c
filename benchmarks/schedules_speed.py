"""How long the pure core takes on a large pipeline: generate, lower, validate, simulate.

For every registered schedule at P ranks x M micro-batches (default 128 x 1024,
v as the schedule needs) this times, in seconds:

* ``generate``  the compute-only schedule (the pure generator + registry checks);
* ``lower``     the lowering passes (grad sync, send/recv) without validation;
* ``validate``  :func:`stagewise.validate_schedule` of the complete schedule;
* ``build``     ``stagewise.build_schedule`` itself, timed as one call (target < 2 s): a little less than
                the three steps' sum, which pays the collector's pass over the live actions three times
                (once at the end of each step's GC pause) where build_schedule pays it once;
* ``build cpu``  the same in CPU time of this process (``time.process_time``): on a shared,
                oversubscribed machine wall time also counts the other jobs' turns;
* ``simulate``  :func:`stagewise.simulation.arrays` of the complete schedule (what ``stagewise simulate`` times);
* ``cli``       ``stagewise simulate --schedule X --stages P --microbatches M --json`` end to end in a fresh
                process (start-up, build, simulate, report; target < 2 s), wall and CPU (``cli cpu``), medians;

and prints one row per schedule, the median of ``--repeat`` runs of each step, with the
load average before and after (the machine is shared). A benchmark, not a test: results
go to benchmarks/RESULTS.md.

    .venv/bin/python -m benchmarks.schedules_speed [--ranks 128] [--microbatches 1024] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import stagewise as sw
from stagewise.passes import lower
from stagewise.schedules import generate
from stagewise.simulation import simulate

T = TypeVar("T")


_CPU: list[float] = []  # process time of the last timed() call


def timed(fn: Callable[..., T], *args: object, **kwargs: object) -> tuple[float, T]:
    start, cpu = time.perf_counter(), time.process_time()
    result = fn(*args, **kwargs)
    _CPU[:] = [time.process_time() - cpu]
    return time.perf_counter() - start, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", "-p", type=int, default=128)
    parser.add_argument("--microbatches", "-m", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=3, help="runs of each step (the median is shown)")
    parser.add_argument("--only", nargs="*", help="schedule names (default: all registered)")
    args = parser.parse_args()
    p, m = args.ranks, args.microbatches
    print(f"stagewise {sw.__version__}, Python {platform.python_version()}, {platform.machine()}; p={p}, m={m}")
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    header = (
        f"{'schedule':<17} {'v':>2} {'actions':>9} {'generate s':>10} {'lower s':>8} {'validate s':>10} "
        f"{'build s':>8} {'build cpu s':>11} {'simulate s':>10} {'bubble':>7} {'cli s':>6} {'cli cpu s':>9}"
    )
    print(header)
    print("-" * len(header))
    for name in args.only or sw.schedule_names():
        print(bench_one(name, p, m, args.repeat), flush=True)
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


def bench_one(name: str, p: int, m: int, repeat: int) -> str:
    v = sw.schedule_info(name).default_virtual_stages
    runs: dict[str, list[float]] = {"generate": [], "lower": [], "validate": [], "simulate": [], "cpu": []}
    runs["build"] = []
    for _ in range(repeat):
        t, built = timed(sw.build_schedule, name, p, m, v)
        runs["build"].append(t)
        runs["cpu"].append(_CPU[0])
        del built
        t, schedule = timed(generate, name, p, m, v)
        runs["generate"].append(t)
        t, complete = timed(lower, schedule, validate=False)
        runs["lower"].append(t)
        t, _ = timed(sw.validate_schedule, complete)  # a fresh object each run: nothing is cached
        runs["validate"].append(t)
        t, result = timed(simulate, complete)
        runs["simulate"].append(t)
    med = {k: statistics.median(v) for k, v in runs.items()}
    build = med["build"]
    actions = sum(len(acts) for acts in complete.ranks)
    return (
        f"{name:<17} {v:>2} {actions:>9} {med['generate']:>10.2f} {med['lower']:>8.2f} {med['validate']:>10.2f} "
        f"{build:>8.2f} {med['cpu']:>11.2f} {med['simulate']:>10.2f} {result.bubble_ratio:>7.1%} "
        f"{cli(name, p, m, repeat)}"
    )


def cli(name: str, p: int, m: int, repeat: int) -> str:
    """Wall and CPU seconds of the ``stagewise simulate ... --json`` command in a fresh interpreter (medians of
    ``repeat`` runs: one start-up can land on a busy moment of a shared machine)."""
    script = Path(sys.executable).with_name("stagewise")  # the console script next to this interpreter
    command = [str(script), "simulate", "--schedule", name, "--ranks", str(p)]
    command += ["--microbatches", str(m), "--json"]
    walls, cpus = [], []
    for _ in range(repeat):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        walls.append(time.perf_counter() - start)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return f"{statistics.median(walls):>6.2f} {statistics.median(cpus):>9.2f}"


if __name__ == "__main__":
    main()
