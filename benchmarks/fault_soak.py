"""Soak the fault matrix: {SIGKILL, SIGSTOP, exception} x {rank 0, 1, 3} x {step, constructor, clip, eval, save, load,
stream, wave} at 4 ranks (rank 0 hosts the store), judged by tests/system/scripts/fault_harness.py (exit codes and
messages: every survivor exits 1 with a PipelineError whose first line blames the victim, or the unreachable
coordinator; no abort, no hang). Prints how many runs of each case passed, the hangs and aborts, the distinct
problems, and how long the survivors took to raise after the fault (median and worst per place, against the
pipeline's timeout + 5 s; measured, never judged).

    .venv/bin/python -m benchmarks.fault_soak --all                    # the whole product once (make fault-matrix)
    .venv/bin/python -m benchmarks.fault_soak --random 100 --seed 0    # 100 faults drawn from the product
    ... [--repeats K] [--parallel 2] [--timeout 10] [--out DIR] [--clean] [--part K/N]

``--clean`` also runs one fault-free job after each round and counts the ones that trained. ``--part K/N`` runs
only the cases whose index in the list is K modulo N (a soak in chunks short enough to share the machine).
The harness and its programs are the system tests', run with pytest's module path.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from ._launch import with_the_tests


def cases_of(args: argparse.Namespace, fh: Any) -> list[Any]:
    """The cases of one round: the whole product, or ``--random N`` of it drawn with ``--seed``; then ``--part``."""
    if args.random:
        rng = random.Random(args.seed)
        cases = [rng.choice(fh.ALL_CASES) for _ in range(args.random)]
    else:
        cases = list(fh.ALL_CASES)
    k_part, n_parts = (int(x) for x in args.part.split("/"))
    return [c for i, c in enumerate(cases) if i % n_parts == k_part]


def report(outcomes: list[Any], timeout: float) -> None:
    """The tables: passed/runs per case, hangs and aborts, latencies per place, the distinct problems."""
    runs: Counter[Any] = Counter(o.case for o in outcomes)
    passed: Counter[Any] = Counter(o.case for o in outcomes if not o.problems)
    print(f"\n{'case':32} passed/runs")
    for case in sorted(runs, key=str):
        print(f"{'-'.join(map(str, case)):32} {passed[case]}/{runs[case]}")
    hangs = sum(any("(None: hung)" in p for p in o.problems) for o in outcomes)
    aborts = sum(any("aborted" in p for p in o.problems) for o in outcomes)
    print(
        f"\nall runs: {sum(passed.values())}/{len(outcomes)} passed; {hangs} with a hung rank; {aborts} with an abort"
    )
    by_place: dict[str, list[float]] = defaultdict(list)
    for o in outcomes:
        if o.latency is not None:
            by_place[o.case[2]].append(o.latency)
    bound = timeout + 5.0
    print(f"\nseconds from the fault to the last survivor's error (timeout {timeout:g} s; timeout + 5 s = {bound:g} s)")
    print(f"{'place':12} {'runs':>5} {'median':>7} {'max':>7} {'over':>5}")
    every = [x for xs in by_place.values() for x in xs]
    for place, xs in sorted(by_place.items()) + [("all", every)]:
        if xs:
            over = sum(x > bound for x in xs)
            print(f"{place:12} {len(xs):5} {statistics.median(xs):7.1f} {max(xs):7.1f} {over:5}")
    problems: Counter[str] = Counter(f"{o.case}: {p[:160]}" for o in outcomes for p in o.problems)
    for text, n in problems.most_common(20):
        print(f"{n:4}x {text}")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--all", action="store_true", help="every case of the product (the default)")
    parser.add_argument("--random", type=int, default=0, help="N faults drawn at random from the product")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=10.0, help="the pipelines' timeout in each job")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--clean", action="store_true")
    parser.add_argument("--part", default="0/1", help="K/N: the cases whose index is K modulo N")
    args = parser.parse_args()
    with_the_tests("benchmarks.fault_soak", "fault_harness")
    import fault_harness as fh

    cases = cases_of(args, fh)
    out = args.out or Path(tempfile.mkdtemp(prefix="fault_soak_"))
    outcomes = []
    clean_ok = 0
    started = time.perf_counter()
    for k in range(args.repeats):
        outcomes += fh.run_cases(cases, out / f"round{k}", parallel=args.parallel, timeout=args.timeout)
        if args.clean:
            codes, _, _ = fh.clean_job(out / f"round{k}" / "clean")
            clean_ok += all(c == 0 for c in codes.values())
        print(f"round {k + 1}/{args.repeats} done after {time.perf_counter() - started:.0f} s", flush=True)
    report(outcomes, args.timeout)
    print(f"\nwall {time.perf_counter() - started:.0f} s for {len(outcomes)} jobs, {args.parallel} at a time")
    if args.clean:
        print(f"clean jobs after a round: {clean_ok}/{args.repeats} trained")
    print(f"(outputs under {out})")


if __name__ == "__main__":
    main()
