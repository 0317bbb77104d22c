"""The flags that meet torch.distributed.pipelining: ``--from-torch`` (read torch's schedule) and
``--torch-csv`` (write one for torch's runtime and torchtitan). torch is imported only when they are given."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from .common import UsageError

if TYPE_CHECKING:
    from ..ir import Schedule

FORMATS = ("compute_only", "compute_comms")


def add_torch_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--torch-read",
        choices=("pipeline_order", "step"),
        default="pipeline_order",
        help="with --from-torch: torch's pipeline_order table (default) or the actions its step() runs",
    )
    add_torch_csv(parser)


def add_torch_csv(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--torch-csv", metavar="PATH", help="write the schedule as torch's schedule CSV")
    parser.add_argument(
        "--torch-format",
        choices=FORMATS,
        default="compute_only",
        help="the --torch-csv format torch's _load_csv is given (default compute_only)",
    )


def add_torchtitan_check(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--torchtitan",
        metavar="CLASS",
        help="with --from-torch FILE.csv: check the file against a torchtitan job naming CLASS as its "
        "pipeline_parallel_schedule, with -p ranks, -m micro-batches (num_pp_microbatches) and -v stages per rank "
        "(default: the class's own); exits 1 naming each problem",
    )


def is_file(value: str) -> bool:
    """``--from-torch`` names a CSV file (rather than a torch class)."""
    return value.lower().endswith(".csv") or "/" in value


def torch_schedule(args: argparse.Namespace) -> Schedule:
    """torch's schedule ``--from-torch CLASS`` for the flags' ranks, micro-batches and stages per rank, or the
    schedule of ``--from-torch FILE.csv`` (checked against the flags: :func:`file_problems`)."""
    from ..interop import from_torch
    from ..runtime.interop import torch_order, torch_pipelining_missing

    if is_file(args.from_torch):
        try:
            return from_torch(Path(args.from_torch))
        except OSError as err:
            raise UsageError(f"--from-torch {args.from_torch}: {err}") from None
    if args.torchtitan:
        raise UsageError("--torchtitan checks a file: give --from-torch FILE.csv")
    missing = torch_pipelining_missing()
    if missing is not None:
        raise UsageError(f"--from-torch needs torch.distributed.pipelining: {missing}")
    order = torch_order(args.from_torch, args.ranks, args.microbatches, args.virtual_stages, read=args.torch_read)
    return from_torch(order)


def file_problems(args: argparse.Namespace, schedule: Schedule) -> list[str]:
    """A file read by ``--from-torch FILE.csv`` against -p and -m (and -v), and against ``--torchtitan CLASS``."""
    from ..interop import torchtitan_problems

    if args.torchtitan:
        return torchtitan_problems(
            schedule,
            args.torchtitan,
            args.microbatches,
            stages_per_rank=args.virtual_stages,
            pipeline_parallel_degree=args.ranks,
        )
    problems = []
    for flag, want, got in (
        ("-p", args.ranks, schedule.num_ranks),
        ("-m", args.microbatches, schedule.num_microbatches),
        ("-v", args.virtual_stages, schedule.virtual_stages),
    ):
        if want is not None and want != got:
            problems.append(f"{flag} {want}: the file has {got}")
    return problems


def torchtitan_lines(schedule: Schedule, path: str) -> list[str]:
    """What torchtitan needs to load ``schedule``'s compute_only file at ``path`` (or why it cannot)."""
    from ..interop import torchtitan_settings

    try:
        return torchtitan_settings(schedule).lines(path)
    except ValueError as err:
        return [f"torchtitan: cannot load it: {err}"]


def write_torch_csv(schedule: Schedule, path: str, format: str) -> None:
    """Write the file (exit 2 naming the path when it cannot be written)."""
    from ..interop import to_torch_csv

    text = to_torch_csv(schedule, format="compute_comms" if format == "compute_comms" else "compute_only")
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError as err:
        raise UsageError(f"--torch-csv {path}: {err}") from None
