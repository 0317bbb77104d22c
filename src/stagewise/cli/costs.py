"""The cost flags ``simulate`` and ``synthesize`` share: uniform per-rank times, or a cost model file."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

from .common import UsageError

if TYPE_CHECKING:
    from ..simulation import CostModel

TIMES = ("f_time", "i_time", "w_time", "comm_time", "sync_time")


def add_times(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--f-time", type=float, default=1.0, metavar="T", help="forward time F per rank (default 1)")
    parser.add_argument(
        "--i-time", type=float, default=1.0, metavar="T", help="input-gradient time I per rank; B = I + W (default 1)"
    )
    # the old spelling (it always meant I, not the full backward B): accepted for one release, not advertised
    parser.add_argument("--b-time", type=float, dest="i_time", help=argparse.SUPPRESS)
    parser.add_argument(
        "--w-time", type=float, default=1.0, metavar="T", help="weight-gradient time W per rank (default 1)"
    )
    parser.add_argument(
        "--comm-time", type=float, default=0.0, metavar="T", help="transfer time between ranks (default 0)"
    )
    parser.add_argument(
        "--sync-time", type=float, default=0.0, metavar="T", help="gradient-sync time per rank (default 0)"
    )
    parser.add_argument(
        "--costs", metavar="PATH", help="per-stage cost model JSON (CostModel.to_dict); replaces the time flags"
    )


def check_times(args: argparse.Namespace) -> None:
    for flag in TIMES:
        value = getattr(args, flag)
        if not 0 <= value < math.inf:
            raise UsageError(f"--{flag.replace('_', '-')} must be a finite number >= 0, got {value}")


def cost_model(args: argparse.Namespace, num_stages: int, v: int, what: str) -> CostModel:
    """``--costs`` (checked against ``num_stages``; ``what`` names the schedule in the error) or uniform
    per-rank times, each stage taking 1/v of its rank's."""
    from ..simulation import CostModel

    if not args.costs:
        return CostModel.uniform(
            num_stages,
            forward=args.f_time / v,
            backward_input=args.i_time / v,
            backward_weight=args.w_time / v,
            comm_time=args.comm_time,
            sync_time=args.sync_time / v,
        )
    costs = load_costs(args.costs)
    if costs.num_stages != num_stages:
        raise UsageError(f"--costs describes {costs.num_stages} stages, but {what} has {num_stages}")
    return costs


def load_costs(path: str) -> CostModel:
    from ..simulation import CostModel

    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise UsageError(f"--costs {path}: {err}") from None
    if not isinstance(data, dict):
        raise UsageError(f"--costs {path}: expected a JSON object (CostModel.to_dict), got {type(data).__name__}")
    return CostModel.from_dict(data)
