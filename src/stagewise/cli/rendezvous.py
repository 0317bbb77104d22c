"""``stagewise rendezvous``: host the rendezvous store of ``stagewise run --nnodes MIN:MAX`` jobs apart from them.

    stagewise rendezvous --port 29400                    # on a machine that runs no workers
    stagewise run -n 8 --nnodes 2:4 --max-restarts 3 --rdzv-endpoint store-host:29400 --rdzv-id job-1f0c \
        train.py                                         # every machine

It prints where the store is and a fresh job name (``--rdzv-id``) for the next job: a job's snapshots are
found by its name, so two jobs must never share one.

Ctrl-C (or SIGTERM) stops it; the jobs that use it cannot meet again afterwards.
"""

from __future__ import annotations

import argparse
import secrets
import signal
import threading

from .common import Subparsers, UsageError


def add_command(sub: Subparsers) -> None:
    parser = sub.add_parser(
        "rendezvous",
        help="host the rendezvous store for elastic jobs (stagewise run --nnodes MIN:MAX) on a machine of its own",
        description="Host torch's rendezvous store (a TCPStore) until stopped, so that elastic jobs survive the "
        "loss of any training machine: give every machine's `stagewise run` --rdzv-endpoint HOST:PORT and no "
        "--rdzv-host.",
    )
    parser.add_argument("--host", default="0.0.0.0", help="the address to listen on (default: every interface)")
    parser.add_argument("--port", type=int, default=29400, help="the port (default 29400; 0: a free one)")
    parser.set_defaults(handler=host_store)


def host_store(args: argparse.Namespace) -> int:
    if not 0 <= args.port < 65536:
        raise UsageError(f"--port must be in 0..65535, got {args.port}")
    from ..runtime.comm.rendezvous_host import serve

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve(args.host, args.port, stop, lambda port: print(ready_line(args.host, port), flush=True))
    except RuntimeError as err:  # torch's DistNetworkError (EADDRINUSE, an address not here): one line, exit 2
        raise UsageError(
            f"cannot host the store at {args.host}:{args.port}: {str(err).splitlines()[0]} (another store or "
            "program holds the port? --port 0 picks a free one)"
        ) from None
    return 0


def ready_line(host: str, port: int) -> str:
    """What the user copies into every machine's command: the endpoint and a job name no job has used."""
    return (
        f"stagewise rendezvous: the store is at {host}:{port}; give each machine of a new job "
        f"--rdzv-endpoint {host}:{port} --rdzv-id job-{secrets.token_hex(4)} (a fresh name for each job)"
    )
