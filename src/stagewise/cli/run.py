"""``stagewise run``: a training script on N local processes with torch's own launcher, restarted if asked.

Ctrl-C ends the job with one line (``interrupted: rank 1 stopped after step 37; last checkpoint
ckpt/step-00000036``) and exit status 130: see :mod:`stagewise.runtime.interrupt`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .common import Subparsers, UsageError


def add_command(sub: Subparsers) -> None:
    parser = sub.add_parser(
        "run",
        help="run a training script on N local processes (torch.distributed.run), restarted on failure if asked",
        description="Launch N local processes of SCRIPT with torch's own launcher "
        "(torchrun --standalone: rendezvous on localhost; with --nnodes, c10d rendezvous across machines). "
        "Arguments after the script go to it. Ctrl-C stops every process and prints one line, where the job "
        "stopped and its last checkpoint; the exit status is then 130.",
    )
    parser.add_argument("-n", "--nproc", type=int, required=True, metavar="N", help="processes (ranks) per machine")
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="N",
        help="restart every process up to N times when one fails (the script resumes: sw.checkpoint.resume)",
    )
    parser.add_argument("--nnodes", type=int, default=1, metavar="M", help="machines (default 1: standalone)")
    parser.add_argument(
        "--node-rank", type=int, default=None, metavar="I", help="this machine's index, 0..M-1 (0 hosts the rendezvous)"
    )
    parser.add_argument(
        "--rdzv-endpoint", default=None, metavar="HOST:PORT", help="where machine 0 hosts the rendezvous (M > 1)"
    )
    parser.add_argument(
        "--local-addr", default=None, metavar="ADDR", help="this machine's address the others reach (M > 1)"
    )
    parser.add_argument("script", help="the training script")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    parser.set_defaults(handler=run_script)


def run_script(args: argparse.Namespace) -> int:
    if args.nproc < 1:
        raise UsageError(f"-n must be >= 1, got {args.nproc}")
    if not Path(args.script).is_file():
        raise UsageError(f"script {args.script!r} is not a file")
    script_args = list(args.script_args)
    if script_args[:1] == ["--"]:
        script_args = script_args[1:]
    from ..runtime.launch import torchrun

    return torchrun([*rendezvous_args(args), f"--nproc-per-node={args.nproc}", args.script, *script_args])


def rendezvous_args(args: argparse.Namespace) -> list[str]:
    """``--standalone`` on one machine; c10d rendezvous at ``--rdzv-endpoint`` across ``--nnodes`` machines."""
    if args.max_restarts < 0:
        raise UsageError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    restarts = [f"--max-restarts={args.max_restarts}"] if args.max_restarts else []
    if args.nnodes < 1:
        raise UsageError(f"--nnodes must be >= 1, got {args.nnodes}")
    if args.nnodes == 1 and args.rdzv_endpoint is None:
        return ["--standalone", *restarts]
    if args.rdzv_endpoint is None or args.node_rank is None:
        raise UsageError(f"--nnodes {args.nnodes} needs --node-rank I and --rdzv-endpoint HOST:PORT (machine 0's)")
    if not 0 <= args.node_rank < args.nnodes:
        raise UsageError(f"--node-rank must be in 0..{args.nnodes - 1}, got {args.node_rank}")
    return [
        f"--nnodes={args.nnodes}",
        f"--node-rank={args.node_rank}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={args.rdzv_endpoint}",
        # machine 0 hosts the rendezvous store: torch guesses it from host names and misses secondary NICs
        f"--rdzv-conf=is_host={str(args.node_rank == 0).lower()}",
        *([f"--local-addr={args.local_addr}"] if args.local_addr else []),
        *restarts,
    ]
