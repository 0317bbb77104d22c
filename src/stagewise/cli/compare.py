"""``stagewise compare``: the methods comparison (``benchmarks/compare_methods.py``) on N local processes.

Thin: it finds the benchmark in the source checkout (the comparison is an
experiment shipped with the repository, not part of the installed library),
turns its options into the benchmark's arguments and launches it as
``stagewise run -n N`` would.
"""

from __future__ import annotations

import argparse
from pathlib import Path

BENCHMARK = Path("benchmarks") / "compare_methods.py"


def find_benchmark() -> Path:
    """The benchmark script: next to this package's source tree, else under the working directory."""
    for root in (Path(__file__).resolve().parents[2], Path.cwd()):
        if (root / BENCHMARK).is_file():
            return root / BENCHMARK
    raise ValueError(
        f"stagewise compare needs {BENCHMARK} from the stagewise source checkout; run it from the repository root"
    )


def add_compare_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "compare",
        help="train every pipeline method on the same data and seeds: table, JSON, plots",
        description="Run benchmarks/compare_methods.py on N local processes (torchrun --standalone). "
        "Arguments after -- go to the benchmark as they are (see its --help).",
    )
    parser.add_argument("-n", "--nproc", type=int, default=2, metavar="N", help="processes (default 2)")
    parser.add_argument("--workload", nargs="+", metavar="NAME", help="gpt, cnn and/or mlp (default: gpt cnn)")
    parser.add_argument("--steps", type=int, help="mini-batches per run, a multiple of the window (default 48)")
    parser.add_argument("--seeds", type=int, nargs="+", help="seeds (default 0 1 2)")
    parser.add_argument("--out", default="out/compare", help="output folder (default out/compare)")
    parser.add_argument("extra", nargs=argparse.REMAINDER, help="more benchmark arguments, after --")
    parser.set_defaults(handler=run_compare)


def compare_arguments(args: argparse.Namespace) -> list[str]:
    """The benchmark's command line for these options."""
    out = ["--out", str(args.out)]
    if args.workload:
        out += ["--workload", *args.workload]
    if args.steps is not None:
        out += ["--steps", str(args.steps)]
    if args.seeds:
        out += ["--seeds", *map(str, args.seeds)]
    extra = list(args.extra)
    return out + (extra[1:] if extra[:1] == ["--"] else extra)


def run_compare(args: argparse.Namespace) -> int:
    if args.nproc < 2:
        raise ValueError(f"-n must be >= 2 (a pipeline needs two processes), got {args.nproc}")
    if args.steps is not None and args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    script = find_benchmark()
    from ..runtime.launch import torchrun

    return torchrun(["--standalone", f"--nproc-per-node={args.nproc}", str(script), *compare_arguments(args)])
