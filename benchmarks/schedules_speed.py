"""How long the pure core takes on a large pipeline: generate, simulate, lower + validate.

For every registered schedule at P ranks x M micro-batches (default 128 x 1024,
v as the schedule needs) this times

* ``generate``        the compute-only schedule (the pure generator + registry checks);
* ``simulate``        :func:`stagewise.simulate.simulate` of that compute-only schedule
                      (makespan, bubble, peak memory);
* ``timeline``        building the result's Timeline (one Event per action; lazy, only renderers need it);
* ``build_schedule``  generate + lowering passes (grad sync, communication) + validation twice;
* ``simulate (lowered)`` the simulator on the complete schedule the runtime would execute;

and prints one row per schedule (best of ``--repeat`` runs for the fast steps, one
run of ``build_schedule``). A benchmark, not a test: results go to benchmarks/RESULTS.md.

    .venv/bin/python benchmarks/schedules_speed.py [--ranks 128] [--microbatches 1024] [--repeat 3]
"""

from __future__ import annotations

import argparse
import platform
import time
from collections.abc import Callable
from typing import TypeVar

import stagewise as sw
from stagewise.simulate import simulate

T = TypeVar("T")


def best_of(repeat: int, fn: Callable[..., T], *args: object) -> tuple[float, T]:
    best, result = float("inf"), None
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn(*args)
        best = min(best, time.perf_counter() - start)
    assert result is not None
    return best, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", "-p", type=int, default=128)
    parser.add_argument("--microbatches", "-m", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=3, help="runs of generate / simulate (best is shown)")
    parser.add_argument("--skip-build", action="store_true", help="do not time build_schedule (the slow part)")
    parser.add_argument("--only", nargs="*", help="schedule names (default: all registered)")
    args = parser.parse_args()
    p, m = args.ranks, args.microbatches
    print(f"stagewise {sw.__version__}, Python {platform.python_version()}, {platform.machine()}; p={p}, m={m}")
    header = (
        f"{'schedule':<14} {'v':>2} {'actions':>9} {'generate s':>11} {'simulate s':>11} {'timeline s':>11} "
        f"{'lower+validate s':>17} {'sim lowered s':>14} {'bubble':>7}"
    )
    print(header)
    print("-" * len(header))
    for name in args.only or sw.schedule_names():
        print(bench_one(name, p, m, args.repeat, args.skip_build), flush=True)


def bench_one(name: str, p: int, m: int, repeat: int, skip_build: bool) -> str:
    v = sw.schedule_info(name).default_virtual_stages
    try:
        t_gen, schedule = best_of(repeat, sw.generate, name, p, m, v)
    except ValueError as err:
        return f"{name:<14} {v:>2} skipped: {err}"
    t_sim, result = best_of(repeat, simulate, schedule)
    t_timeline = min(best_of(1, lambda r: r.timeline, simulate(schedule))[0] for _ in range(repeat))
    actions = sum(len(acts) for acts in schedule.ranks)
    t_build = t_sim_full = float("nan")
    if not skip_build:
        t_build, complete = best_of(1, sw.build_schedule, name, p, m, v)
        t_sim_full, _ = best_of(repeat, simulate, complete)
    return (
        f"{name:<14} {v:>2} {actions:>9} {t_gen:>11.3f} {t_sim:>11.3f} {t_timeline:>11.3f} "
        f"{t_build:>17.2f} {t_sim_full:>14.3f} {result.bubble_ratio:>7.1%}"
    )


if __name__ == "__main__":
    main()
