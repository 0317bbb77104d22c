"""``stagewise run``: a training script on N local processes with torch's own launcher, restarted if asked.

Ctrl-C ends the job with one line (``interrupted: rank 1 stopped after step 37; last checkpoint
ckpt/step-00000036``) and exit status 130: see :mod:`stagewise.runtime.interrupt`.

``--nnodes MIN:MAX`` makes the job elastic (torch's elastic agent and c10d rendezvous: a machine lost for
good costs a restart of the survivors' processes at the smaller size, a machine that starts is taken in):
the machines are numbered by the rendezvous, ``--rdzv-host`` says which one hosts its store (or none, when
``stagewise rendezvous`` does, apart), and a failed rendezvous is one line (:mod:`stagewise.runtime.elastic`).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import NamedTuple

from .common import Subparsers, UsageError


def add_command(sub: Subparsers) -> None:
    parser = sub.add_parser(
        "run",
        help="run a training script on N local processes (torch.distributed.run), restarted on failure if asked",
        description="Launch N local processes of SCRIPT with torch's own launcher "
        "(torchrun --standalone: rendezvous on localhost; with --nnodes, c10d rendezvous across machines; "
        "with --nnodes MIN:MAX, elastic: the job goes on after a machine is lost and takes machines back in). "
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
    _add_machines(parser)
    parser.add_argument(
        "--metrics",
        default=None,
        metavar="DIR",
        help="every pipeline of the script that sets no metrics= writes its per-step metrics under DIR (JSON lines, "
        "and TensorBoard event files when tensorboard is installed: tensorboard --logdir DIR)",
    )
    parser.add_argument(
        "--pin-cores",
        action="store_true",
        help="each local rank on its own core(s), an equal share of the cores this machine gives the job (refused "
        "when N exceeds them; torchrun's --numa-binding places by GPU): steadier steps on a small machine",
    )
    parser.add_argument("script", help="the training script")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    parser.set_defaults(handler=run_script)


def _add_machines(parser: argparse.ArgumentParser) -> None:
    """The options of a job over several machines (``--nnodes``, the rendezvous, this machine's address)."""
    parser.add_argument(
        "--nnodes",
        type=_nodes,
        default=Nodes(1, 1, False),
        metavar="M|MIN:MAX",
        help="machines (default 1: standalone); MIN:MAX: elastic, the job goes on while MIN machines remain and "
        "takes machines back in, up to MAX (needs --max-restarts)",
    )
    parser.add_argument(
        "--node-rank", type=int, default=None, metavar="I", help="this machine's index, 0..M-1 (0 hosts the rendezvous)"
    )
    parser.add_argument(
        "--rdzv-endpoint", default=None, metavar="HOST:PORT", help="where the rendezvous store is hosted (M > 1)"
    )
    parser.add_argument(
        "--rdzv-host",
        action="store_true",
        help="MIN:MAX: this machine hosts the rendezvous store at --rdzv-endpoint (else `stagewise rendezvous` does, "
        "or another machine given --rdzv-host)",
    )
    parser.add_argument(
        "--rdzv-id", default=None, metavar="ID", help="the job's name in the rendezvous, alike on every machine"
    )
    parser.add_argument(
        "--rdzv-conf",
        default=None,
        metavar="K=V,...",
        help="torch's rendezvous settings (join_timeout, last_call_timeout, keep_alive_interval, ...); MIN:MAX "
        "defaults to keep_alive_interval=1,keep_alive_max_attempt=3,last_call_timeout=2 (a lost machine noticed "
        "in 3 s, a round closed 2 s after MIN machines met)",
    )
    parser.add_argument(
        "--local-addr", default=None, metavar="ADDR", help="this machine's address the others reach (M > 1)"
    )
    parser.add_argument(
        "--in-place",
        action="store_true",
        help="MIN:MAX, for scripts that train with sw.runtime.InPlace: a lost machine restarts nobody, the "
        "survivors keep their processes and agree on the next membership on the store of `stagewise rendezvous` at "
        "--rdzv-endpoint",
    )


def run_script(args: argparse.Namespace) -> int:
    if args.nproc < 1:
        raise UsageError(f"-n must be >= 1, got {args.nproc}")
    if not Path(args.script).is_file():
        raise UsageError(f"script {args.script!r} is not a file")
    script_args = list(args.script_args)
    if script_args[:1] == ["--"]:
        script_args = script_args[1:]
    from ..runtime.launch import torchrun

    argv = [*rendezvous_args(args), f"--nproc-per-node={args.nproc}", *_pinned(args), args.script, *script_args]
    metrics = metrics_env(args.metrics)
    if _elastic(args):
        return _elastic_run(args, argv, metrics)
    return torchrun(argv, env=metrics) if metrics else torchrun(argv)


def _pinned(args: argparse.Namespace) -> list[str]:
    """``--pin-cores``: each worker runs the script through :mod:`stagewise.runtime.measure.cores`, which pins it
    first; too many processes for the cores is refused here, before any starts."""
    if not args.pin_cores:
        return []
    import os

    from ..runtime.measure.cores import core_sets

    try:
        core_sets(args.nproc, sorted(os.sched_getaffinity(0)))
    except ValueError as err:
        raise UsageError(f"--pin-cores: {str(err).removeprefix('pin cores: ')}") from None
    return ["-m", "stagewise.runtime.measure.cores"]


def metrics_env(folder: str | None) -> dict[str, str]:
    """``--metrics DIR``: the variable the workers' pipelines read (:mod:`stagewise.runtime.reporting.config`),
    the folder made absolute (the workers may change directory)."""
    if folder is None:
        return {}
    if not folder.strip():
        raise UsageError("--metrics needs a folder, got an empty string")
    return {"STAGEWISE_METRICS": str(Path(folder).resolve())}


def _elastic_run(args: argparse.Namespace, argv: list[str], metrics: dict[str, str]) -> int:
    """``--nnodes MIN:MAX``: the workers' environment, one line per failure (tracebacks in a folder kept after
    the job), one line for a failed rendezvous."""
    import os
    import tempfile
    import time

    from ..runtime.elastic.launch import FAST_RDZV, elastic_env, rendezvous_failure, watched
    from ..runtime.interrupt import TRACEBACK_ENV
    from ..runtime.launch import torchrun

    nodes, endpoint, conf = args.nnodes, args.rdzv_endpoint, args.rdzv_conf or ""
    settings = {**FAST_RDZV, **dict(item.split("=", 1) for item in conf.split(",") if "=" in item)}
    stamp = time.strftime("%Y%m%d-%H%M%S")
    traces = os.path.join(tempfile.gettempdir(), f"stagewise-{_safe(args.rdzv_id)}-{stamp}-{os.getpid()}")
    env = {**elastic_env(nodes.low, nodes.high), TRACEBACK_ENV: traces, **metrics}
    watch = lambda folder: watched(folder, args.nproc, settings, traces)  # noqa: E731
    if args.in_place:
        from ..runtime.elastic.agent import in_place_agent, watched_in_place
        from ..runtime.elastic.membership import STORE_ENV

        env[STORE_ENV] = endpoint
        watch = lambda folder: watched_in_place(watched(folder, args.nproc, settings, traces), in_place_agent())  # noqa: E731
    return torchrun(argv, env=env, explain=lambda err: rendezvous_failure(err, endpoint, nodes, conf), watch=watch)


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in name)


def rendezvous_args(args: argparse.Namespace) -> list[str]:
    """``--standalone`` on one machine; c10d rendezvous at ``--rdzv-endpoint`` across ``--nnodes`` machines."""
    if args.max_restarts < 0:
        raise UsageError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    restarts = [f"--max-restarts={args.max_restarts}"] if args.max_restarts else []
    high = args.nnodes.high
    if _elastic(args):
        return _elastic_args(args, restarts)
    if args.in_place:  # (accepted and ignored before: the job ran as a fixed one, restarting on a loss)
        raise UsageError(
            f"--in-place keeps the survivors' processes when a machine is lost, which needs --nnodes MIN:MAX (the "
            f"sizes the job may run at), not --nnodes {high}"
        )
    if args.rdzv_host:
        raise UsageError("--rdzv-host is for --nnodes MIN:MAX (with a fixed --nnodes, --node-rank 0 hosts)")
    if high == 1 and args.rdzv_endpoint is None:
        return ["--standalone", *restarts]
    if args.rdzv_endpoint is None or args.node_rank is None:
        raise UsageError(f"--nnodes {high} needs --node-rank I and --rdzv-endpoint HOST:PORT (machine 0's)")
    if not 0 <= args.node_rank < high:
        raise UsageError(f"--node-rank must be in 0..{high - 1}, got {args.node_rank}")
    return [
        f"--nnodes={high}",
        f"--node-rank={args.node_rank}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={args.rdzv_endpoint}",
        *([f"--rdzv-id={args.rdzv_id}"] if args.rdzv_id else []),
        # machine 0 hosts the rendezvous store: torch guesses it from host names and misses secondary NICs
        f"--rdzv-conf={_conf(args, args.node_rank == 0)}",
        *([f"--local-addr={args.local_addr}"] if args.local_addr else []),
        *restarts,
    ]


def _elastic(args: argparse.Namespace) -> bool:
    return bool(args.nnodes.elastic)


def _elastic_args(args: argparse.Namespace, restarts: list[str]) -> list[str]:
    """``--nnodes MIN:MAX``: torch's elastic agent and c10d rendezvous; the machines are numbered by the
    rendezvous (no --node-rank), and the store is hosted where --rdzv-host says (see docs/guides/elastic.md)."""
    low, high = args.nnodes.low, args.nnodes.high
    if args.rdzv_endpoint is None:
        raise UsageError(f"--nnodes {low}:{high} needs --rdzv-endpoint HOST:PORT (where the rendezvous store is)")
    if args.node_rank is not None:
        raise UsageError(
            f"--nnodes {low}:{high} numbers the machines at each rendezvous: drop --node-rank (--rdzv-host says "
            "which machine hosts the rendezvous store)"
        )
    if args.in_place and args.rdzv_host:
        raise UsageError(
            "--in-place: the survivors meet on the rendezvous store after any machine is lost, so no training "
            "machine may host it: drop --rdzv-host and host it with `stagewise rendezvous`"
        )
    if not restarts and not args.in_place:
        raise UsageError(
            f"--nnodes {low}:{high} goes on after a lost machine by restarting the survivors' processes: give "
            "--max-restarts N (N >= 1: how many losses and failures the job may survive)"
        )
    if not args.rdzv_id:
        raise UsageError(
            f"--nnodes {low}:{high} needs --rdzv-id ID: the job's name, the same on every machine and used by no "
            "other job (each machine's snapshots are found by it: two jobs of one name would resume from each "
            'other\'s). `stagewise rendezvous` prints a fresh one; under Slurm, --rdzv-id "$SLURM_JOB_ID"'
        )
    from ..runtime.elastic.launch import FAST_RDZV

    return [
        f"--nnodes={low}:{high}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={args.rdzv_endpoint}",
        f"--rdzv-id={args.rdzv_id}",
        f"--rdzv-conf={_conf(args, args.rdzv_host, FAST_RDZV)}",
        *([f"--local-addr={args.local_addr}"] if args.local_addr else []),
        *restarts,
    ]


def _conf(args: argparse.Namespace, is_host: bool, defaults: dict[str, str] | None = None) -> str:
    """``is_host=...`` (torch guesses it from host names, which misses secondary NICs and network namespaces),
    then the user's ``--rdzv-conf``, then the ``defaults`` it does not set."""
    extra = [item for item in (args.rdzv_conf or "").split(",") if item]
    for item in extra:
        key = item.split("=", 1)[0]
        if "=" not in item or not key:
            raise UsageError(f"--rdzv-conf takes KEY=VALUE pairs separated by commas, got {item!r}")
        if key == "is_host":
            raise UsageError("--rdzv-conf is_host=... is set by stagewise run (--rdzv-host, or --node-rank 0)")
    given = {item.split("=", 1)[0] for item in extra}
    extra += [f"{k}={v}" for k, v in (defaults or {}).items() if k not in given]
    return ",".join([f"is_host={str(is_host).lower()}", *extra])


class Nodes(NamedTuple):
    """``--nnodes``: how many machines, at least and at most; ``elastic`` when written ``MIN:MAX``."""

    low: int
    high: int
    elastic: bool


def _nodes(text: str) -> Nodes:
    """``M`` -> a fixed count; ``MIN:MAX`` -> elastic (even when MIN == MAX: the rendezvous numbers the machines)."""
    low, sep, high = text.partition(":")
    try:
        nodes = Nodes(int(low), int(high if sep else low), bool(sep))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--nnodes takes M or MIN:MAX, got {text!r}") from None
    if nodes.low < 1 or nodes.high < nodes.low:
        raise argparse.ArgumentTypeError(f"--nnodes must be >= 1 (M, or MIN:MAX with MIN <= MAX), got {text!r}")
    return nodes
