"""The ``stagewise`` command: list schedules, simulate and draw one, launch a script on local ranks.

Each subcommand is one ``_add_<name>(subparsers)`` function that defines its
arguments and the handler to call; :data:`_SUBCOMMANDS` lists them, so a new
subcommand is one function and one entry. Handlers return the exit status.
Bad arguments, including values the library rejects with ``ValueError``, exit
with status 2 and a one-line reason on stderr; a schedule that fails
validation (a generator bug, not a bad argument) exits 1 with every problem.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..ir import Schedule
    from ..simulate import CostModel, SimResult

Handler = Callable[[argparse.Namespace], int]


class UsageError(Exception):
    """A bad command line: reported on one line, exit status 2."""


# ---- stagewise schedules ------------------------------------------------------------


def _add_schedules(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("schedules", help="list the registered schedules", description="List the schedules.")
    parser.set_defaults(handler=_cmd_schedules)


def _cmd_schedules(args: argparse.Namespace) -> int:
    from ..schedules import schedule_info, schedule_names

    infos = [schedule_info(name) for name in schedule_names()]
    width = max((len(info.name) for info in infos), default=0)
    for info in infos:
        v = "v any" if info.virtual_stages is None else "v=" + "|".join(map(str, info.virtual_stages))
        print(f"{info.name:<{width}}  {info.summary}  [bubble {info.bubble}; {v}]")
    return 0


# ---- stagewise simulate -------------------------------------------------------------

_SIMULATE_HELP = """\
Simulate one step of a schedule under uniform costs and report its makespan,
bubble and peak activation memory.

Times are per micro-batch and per rank: --f-time is the forward of one
micro-batch through one rank's share of the model (with v virtual stages each
stage takes T/v), likewise --i-time and --w-time. The backward is split as
B = I + W: --i-time is I, the input-gradient part (what the previous rank
waits for), --w-time is W, the weight-gradient part. Schedules without split
backward run a full B costing I + W. --comm-time is the time a value takes to
reach the next rank (it overlaps compute). Cost units are arbitrary; the
trace file shows 1 unit as 1 ms. --costs FILE reads a per-stage cost model
instead (JSON written by CostModel.to_dict, e.g. from a profiler).
"""


def _add_simulate(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "simulate",
        help="simulate a schedule and draw it",
        description=_SIMULATE_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--schedule", "-s", required=True, metavar="NAME", help="registered name (see `stagewise schedules`)"
    )
    # not required=True: argparse would then refuse the hidden --stages alias below; checked in _check_simulate_args
    parser.add_argument("--ranks", "-p", type=int, metavar="P", help="number of ranks P (pipeline degree); required")
    # the old spelling (it always meant ranks, not stages): accepted for one release, not advertised
    parser.add_argument("--stages", type=int, dest="ranks", help=argparse.SUPPRESS)
    parser.add_argument("--microbatches", "-m", type=int, required=True, metavar="M", help="micro-batches per step")
    parser.add_argument(
        "--virtual-stages",
        "-v",
        type=int,
        default=None,
        metavar="V",
        help="stages per rank (default: the schedule's own)",
    )
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
    parser.add_argument("--png", metavar="PATH", help="write a Gantt chart PNG")
    parser.add_argument("--trace", metavar="PATH", help="write a Chrome/Perfetto trace JSON")
    parser.add_argument("--ascii", action="store_true", help="print a text chart")
    parser.add_argument("--width", type=int, default=120, metavar="N", help="width of the text chart (default 120)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a summary")
    parser.set_defaults(handler=_cmd_simulate)


def _check_simulate_args(args: argparse.Namespace) -> None:
    if args.ranks is None:
        raise UsageError("--ranks P is required: the number of ranks (pipeline degree)")
    if args.ranks < 1:
        raise UsageError(f"--ranks must be >= 1, got {args.ranks}")
    if args.microbatches < 1:
        raise UsageError(f"--microbatches must be >= 1, got {args.microbatches}")
    if args.virtual_stages is not None and args.virtual_stages < 1:
        raise UsageError(f"--virtual-stages must be >= 1, got {args.virtual_stages}")
    for flag in ("f_time", "i_time", "w_time", "comm_time", "sync_time"):
        value = getattr(args, flag)
        if not 0 <= value < math.inf:
            raise UsageError(f"--{flag.replace('_', '-')} must be a finite number >= 0, got {value}")
    if args.width < 10:
        raise UsageError(f"--width must be >= 10, got {args.width}")


def _cmd_simulate(args: argparse.Namespace) -> int:
    from .. import build_schedule
    from .._util import gc_paused
    from ..simulate import simulate

    _check_simulate_args(args)
    # one short-lived process making millions of acyclic objects: no collector passes over them, and they
    # are dropped before the pause ends (re-enabled with them alive, the next allocation would scan them all)
    with gc_paused():
        schedule = build_schedule(args.schedule, args.ranks, args.microbatches, args.virtual_stages)
        result = simulate(schedule, _simulate_costs(args, schedule))
        # asynchronous schedules: labels "3v1" (for what draws the timeline) and versions kept
        versions = _async_versions(schedule, result, label=bool(args.png or args.trace or not args.json))
        if args.png:
            from ..render import render_png

            render_png(result.timeline, args.png)
        if args.trace:
            from ..render import render_trace

            render_trace(result.timeline, args.trace)
        if args.json:
            print(json.dumps(_simulate_report(args, schedule, result, versions)))
        else:
            _print_simulation(args, schedule, result)
        del schedule, result, versions
    return 0


def _simulate_costs(args: argparse.Namespace, schedule: Schedule) -> CostModel:
    """The cost model: ``--costs`` (checked against the schedule's stage count) or uniform per-rank times."""
    from ..simulate import CostModel

    v = schedule.virtual_stages
    if not args.costs:
        return CostModel.uniform(
            schedule.num_stages,
            forward=args.f_time / v,
            backward_input=args.i_time / v,
            backward_weight=args.w_time / v,
            comm_time=args.comm_time,
            sync_time=args.sync_time / v,
        )
    costs = _load_costs(args.costs)
    if costs.num_stages != schedule.num_stages:
        raise UsageError(
            f"--costs describes {costs.num_stages} stages, but {args.schedule} with {args.ranks} ranks and "
            f"{v} stages per rank has {schedule.num_stages}"
        )
    return costs


def _simulate_report(
    args: argparse.Namespace, schedule: Schedule, result: SimResult, versions: dict[str, object]
) -> dict[str, object]:
    """What ``simulate --json`` prints."""
    times: dict[str, object] = {
        "f_time": args.f_time,
        "i_time": args.i_time,
        "b_time": args.i_time,  # the old key (it meant I), kept for one release
        "w_time": args.w_time,
        "comm_time": args.comm_time,
        "sync_time": args.sync_time,
    }
    return {
        "schedule": args.schedule,
        "ranks": schedule.num_ranks,
        "stages": schedule.num_ranks,  # the old key (it meant ranks), kept for one release
        "microbatches": schedule.num_microbatches,
        "virtual_stages": schedule.virtual_stages,
        "makespan": result.makespan,
        "bubble_ratio": result.bubble_ratio,
        "peak_activations": result.peak_activations,
        "peak_activation_bytes": result.peak_activation_bytes,
        **versions,
        "costs": {"file": args.costs} if args.costs else times,
    }


def _print_simulation(args: argparse.Namespace, schedule: Schedule, result: SimResult) -> None:
    v = schedule.virtual_stages
    stages = f"{v} stage{'s' if v > 1 else ''} per rank"
    times = (
        f"costs from {args.costs}"
        if args.costs
        else f"F={args.f_time:g} I={args.i_time:g} W={args.w_time:g} comm={args.comm_time:g}"
    )
    print(f"{args.schedule}: {schedule.num_ranks} ranks, {stages}, {schedule.num_microbatches} micro-batches ({times})")
    print(f"  makespan   {result.makespan:g}")
    print(f"  bubble     {result.bubble_ratio:.1%}")
    print(f"  peak activations (micro-batches) per rank: {_short_list(result.peak_activations)}")
    for flag, path in (("png", args.png), ("trace", args.trace)):
        if path:
            print(f"  wrote {flag}: {path}")
    if args.ascii:
        from ..render import render_ascii

        print()
        print(render_ascii(result.timeline, width=args.width))


def _load_costs(path: str) -> CostModel:
    from ..simulate import CostModel

    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise UsageError(f"--costs {path}: {err}") from None
    if not isinstance(data, dict):
        raise UsageError(f"--costs {path}: expected a JSON object (CostModel.to_dict), got {type(data).__name__}")
    return CostModel.from_dict(data)


def _short_list(values: Sequence[float], limit: int = 16) -> str:
    shown = " ".join(f"{x:g}" for x in values[:limit])
    return shown + (f" ... ({len(values)} ranks)" if len(values) > limit else "")


# ---- stagewise run ------------------------------------------------------------------


def _add_run(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "run",
        help="run a training script on N local processes (torch.distributed.run), restarted on failure if asked",
        description="Launch N local processes of SCRIPT with torch's own launcher "
        "(torchrun --standalone: rendezvous on localhost; with --nnodes, c10d rendezvous across machines). "
        "Arguments after the script go to it.",
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
    parser.set_defaults(handler=_cmd_run)


def _cmd_run(args: argparse.Namespace) -> int:
    if args.nproc < 1:
        raise UsageError(f"-n must be >= 1, got {args.nproc}")
    if not Path(args.script).is_file():
        raise UsageError(f"script {args.script!r} is not a file")
    script_args = list(args.script_args)
    if script_args[:1] == ["--"]:
        script_args = script_args[1:]
    from ..runtime.launch import torchrun

    return torchrun([*_rendezvous_args(args), f"--nproc-per-node={args.nproc}", args.script, *script_args])


def _rendezvous_args(args: argparse.Namespace) -> list[str]:
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


# ---- stagewise plan (stagewise.cli.plan) ----------------------------------------


def _add_plan(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from .plan import add_plan_command

    add_plan_command(sub)


# ---- stagewise compare (stagewise.cli.compare) ---------------------------------


def _add_compare(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from .compare import add_compare_command

    add_compare_command(sub)


# ---- entry point --------------------------------------------------------------------

#: one function per subcommand; add a subcommand by writing ``_add_<name>`` and listing it here
_SUBCOMMANDS: list[Callable[[argparse._SubParsersAction[argparse.ArgumentParser]], None]] = [
    _add_schedules,
    _add_simulate,
    _add_run,
    _add_plan,
    _add_compare,
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stagewise", description="Pipeline-parallel schedules: list, simulate, draw, run."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in _SUBCOMMANDS:
        add(sub)
    return parser


def _async_versions(schedule: Schedule, result: SimResult, *, label: bool = True) -> dict[str, object]:
    """For an asynchronous schedule: label the timeline's boxes with their versions (when it will be drawn),
    report the versions kept (only the peaks: the full memory report costs seconds at 128 x 1024)."""
    from ..simulate import labelled_timeline, peak_versions
    from ..validate import async_table

    if async_table(schedule) is None:
        return {}
    if label:
        labelled_timeline(schedule, result)
    return {"peak_weight_versions": peak_versions(schedule)}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``stagewise`` command line; returns the exit status (2 for bad arguments)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse has printed its usage message
        return int(exit_.code or 0)
    from ..validate import ScheduleError

    handler: Handler = args.handler
    try:
        return handler(args)
    except ScheduleError as err:  # a generator bug, not a bad argument: show every problem
        print(f"stagewise {args.command}: {err}", file=sys.stderr)
        return 1
    except (UsageError, ValueError) as err:
        reason = " ".join(str(err).split("\n")[0].split())
        print(f"stagewise {args.command}: error: {reason}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
