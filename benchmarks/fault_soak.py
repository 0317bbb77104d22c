"""Soak the fault matrix: every case of {SIGKILL, SIGSTOP, exception} x {rank 0, 1, 3} x {step, constructor, clip}
at 4 ranks (rank 0 hosts the store), repeated; prints how many runs of each case passed the judge
(tests/system/scripts/fault_harness.py: exit codes and messages), then the distinct problems seen.

    .venv/bin/python -m benchmarks.fault_soak --repeats 4 --parallel 2 [--out DIR] [--clean] [--part K/N]

``--clean`` also runs one fault-free job after each round and counts the ones that trained. ``--part K/N`` runs
only the cases whose index in the matrix is K modulo N (a soak in chunks short enough to share the machine).
The harness and its programs are the system tests', run with pytest's module path.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import Counter
from pathlib import Path

from ._launch import with_the_tests


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--clean", action="store_true")
    parser.add_argument("--part", default="0/1", help="K/N: the cases whose index is K modulo N")
    args = parser.parse_args()
    with_the_tests("benchmarks.fault_soak", "fault_harness")
    import fault_harness as fh

    k_part, n_parts = (int(x) for x in args.part.split("/"))
    cases = [c for i, c in enumerate(fh.ALL_CASES) if i % n_parts == k_part]
    out = args.out or Path(tempfile.mkdtemp(prefix="fault_soak_"))
    passed: Counter[fh.Case] = Counter()
    runs: Counter[fh.Case] = Counter()
    problems: Counter[str] = Counter()
    clean_ok = 0
    started = time.perf_counter()
    for k in range(args.repeats):
        for o in fh.run_cases(cases, out / f"round{k}", parallel=args.parallel):
            runs[o.case] += 1
            passed[o.case] += not o.problems
            for p in o.problems:
                problems[f"{o.case}: {p[:160]}"] += 1
        if args.clean:
            codes, reports, _ = fh.clean_job(out / f"round{k}" / "clean")
            clean_ok += all(c == 0 for c in codes.values())
        print(f"round {k + 1}/{args.repeats} done after {time.perf_counter() - started:.0f} s", flush=True)
    print(f"\n{'case':32} passed/runs")
    for case in cases:
        print(f"{'-'.join(map(str, case)):32} {passed[case]}/{runs[case]}")
    total = sum(runs.values())
    print(f"\nall cases: {sum(passed.values())}/{total} passed; wall {time.perf_counter() - started:.0f} s")
    if args.clean:
        print(f"clean jobs after a round: {clean_ok}/{args.repeats} trained")
    for text, n in problems.most_common(20):
        print(f"{n:4}x {text}")
    print(f"(outputs under {out})")


if __name__ == "__main__":
    main()
