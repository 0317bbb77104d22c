"""The flags that meet torch.distributed.pipelining: ``--from-torch`` (read torch's schedule) and
``--torch-csv`` (write one for torch's runtime and torchtitan). torch is imported only when they are given."""

from __future__ import annotations

import argparse
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


def torch_schedule(args: argparse.Namespace) -> Schedule:
    """torch's schedule ``--from-torch CLASS`` for the flags' ranks, micro-batches and stages per rank."""
    from ..interop import from_torch
    from ..runtime.interop import torch_order, torch_pipelining_missing

    missing = torch_pipelining_missing()
    if missing is not None:
        raise UsageError(f"--from-torch needs torch.distributed.pipelining: {missing}")
    order = torch_order(args.from_torch, args.ranks, args.microbatches, args.virtual_stages, read=args.torch_read)
    return from_torch(order)


def write_torch_csv(schedule: Schedule, path: str, format: str) -> str:
    """Write the file; returns how its stages are placed, for the summary line (torchtitan needs to know)."""
    from ..interop import to_torch_csv, torch_placement

    text = to_torch_csv(schedule, format="compute_comms" if format == "compute_comms" else "compute_only")
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError as err:
        raise UsageError(f"--torch-csv {path}: {err}") from None
    style = torch_placement(schedule)
    return {"loop": "stage s on rank s % P", "v": "stages in a V, 2 per rank"}.get(str(style), "stages as its rows say")
