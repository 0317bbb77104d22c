"""``stagewise compare``: the methods comparison (``python -m benchmarks.compare``) on N local processes.

The comparison is an experiment of the source repository, not library code:
it trains the examples' GPT and CNN on scikit-learn's digits and draws with
matplotlib, and lives in ``benchmarks/compare/`` beside them. A wheel ships
neither, so this command runs the benchmark from a source checkout - the one
stagewise is installed from (``pip install -e .``), else the working
directory - and, from a wheel with no checkout at hand, exits 2 saying so.
It turns its options into the benchmark's arguments and starts the ranks as
``stagewise run -n N`` would.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from .common import Subparsers, UsageError

#: the benchmark's module, and the file that marks a checkout holding it
MODULE = "benchmarks.compare"
MARKER = Path("benchmarks") / "compare" / "__main__.py"
#: what the benchmark imports from the checkout besides itself (benchmarks/compare/workloads.py: the examples)
NEEDED = tuple(Path("examples") / f"{name}.py" for name in ("digits_cnn", "gpt_data", "gpt_model"))


#: the benchmark's asynchronous window by default (its --window; a test holds them alike): --steps must be a whole
#: number of windows, refused here, not once per launched rank
WINDOW = 8

#: the benchmark's workloads (benchmarks/compare/workloads.py; a test holds them alike): a misspelt one is refused
#: here, not once per launched rank
WORKLOADS = ("cnn", "gpt", "mlp")


def add_command(sub: Subparsers) -> None:
    parser = sub.add_parser(
        "compare",
        help="train every pipeline method on the same data and seeds: table, JSON, plots",
        description="Run the benchmark benchmarks/compare (python -m benchmarks.compare) from a stagewise source "
        "checkout on N local processes (torchrun --standalone). "
        "Arguments after -- go to the benchmark as they are (see its --help).",
    )
    parser.add_argument("-n", "--nproc", type=int, default=2, metavar="N", help="processes (default 2)")
    parser.add_argument(
        "--workload", nargs="+", choices=WORKLOADS, metavar="NAME", help="gpt, cnn and/or mlp (default: gpt cnn)"
    )
    parser.add_argument("--steps", type=int, help="mini-batches per run, a multiple of the window (default 48)")
    parser.add_argument("--seeds", type=int, nargs="+", help="seeds (default 0 1 2)")
    parser.add_argument("--out", default="out/compare", help="output folder (default out/compare)")
    parser.add_argument("extra", nargs=argparse.REMAINDER, help="more benchmark arguments, after --")
    parser.set_defaults(handler=run_compare)


def find_checkout() -> Path:
    """The source checkout holding the benchmark: the one this package was installed from, else the working
    directory."""
    for root in (Path(__file__).resolve().parents[3], Path.cwd()):
        if (root / MARKER).is_file():
            missing = [str(p) for p in NEEDED if not (root / p).is_file()]
            if missing:  # a partial copy: the benchmark would fail in every rank at its first import
                raise UsageError(
                    f"stagewise compare trains the examples' models, and {root} holds {MARKER.parent}/ without "
                    f"{', '.join(missing)}: run it from a whole checkout"
                )
            return root
    raise UsageError(
        f"stagewise compare runs the benchmark {MARKER.parent}/ of a stagewise source checkout, and neither this "
        f"installation nor the working directory {Path.cwd()} is one: run it from the repository's root"
    )


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


def torchrun_arguments(args: argparse.Namespace) -> list[str]:
    """What torchrun gets: N local ranks, each running the benchmark's module with its arguments."""
    return ["--standalone", f"--nproc-per-node={args.nproc}", "-m", MODULE, *compare_arguments(args)]


def run_compare(args: argparse.Namespace) -> int:
    if args.nproc < 2:
        raise UsageError(f"-n must be >= 2 (a pipeline needs two processes), got {args.nproc}")
    if args.steps is not None and args.steps < 1:
        raise UsageError(f"--steps must be >= 1, got {args.steps}")
    window = _window(args.extra)
    if args.steps is not None and window and args.steps % window:
        raise UsageError(
            f"--steps ({args.steps}) must be a multiple of the benchmark's window ({window} mini-batches; "
            "-- --window N sets it): whole windows only"
        )
    root = find_checkout()
    # the ranks import the benchmark by name (torchrun -m) from whatever directory this was started in
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    from ..runtime.launch import torchrun

    return torchrun(torchrun_arguments(args))


def _window(extra: list[str]) -> int | None:
    """The window the benchmark will run: its ``--window`` among the arguments after ``--``, else its default
    (None where the value is not a number: the benchmark refuses it itself)."""
    for k, arg in enumerate(extra):
        value = extra[k + 1] if arg == "--window" and k + 1 < len(extra) else arg.partition("=")[2]
        if arg == "--window" or arg.startswith("--window="):
            return int(value) if value.isdigit() else None
    return WINDOW
