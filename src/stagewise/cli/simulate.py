"""``stagewise simulate``: one step of a schedule under uniform (or given) costs; makespan, bubble, memory, charts.

Bad arguments raise :class:`~.common.UsageError` (exit 2); a schedule that
fails validation raises ``ScheduleError`` (exit 1, every problem shown).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .common import Subparsers, UsageError
from .costs import add_times, check_times, cost_model
from .torch_files import (
    add_torch_flags,
    add_torchtitan_check,
    file_problems,
    is_file,
    torch_schedule,
    torchtitan_lines,
    write_torch_csv,
)

if TYPE_CHECKING:
    from ..ir import Schedule
    from ..simulation import CostModel, SimResult

_HELP = """\
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

--from-torch CLASS simulates and draws torch.distributed.pipelining's own
schedule instead (ZBVZeroBubble, Interleaved1F1B, ... or ScheduleZBVZeroBubble;
needs torch): its pipeline_order table, or with --torch-read step the actions
its step() runs. --from-torch FILE.csv reads a schedule file (torch's
_dump_csv, stagewise's --torch-csv), checks it against -p, -m (and -v) and
prints the torchtitan settings that load it; with --torchtitan CLASS it checks
the file against a torchtitan job (format, class, stages per rank, micro-batch
count) and exits 1 naming each problem. --torch-csv FILE writes the schedule as
the CSV torch's _PipelineScheduleRuntime (and torchtitan's schedule CSV option)
loads.
"""


def add_command(sub: Subparsers) -> None:
    parser = sub.add_parser(
        "simulate",
        help="simulate a schedule and draw it",
        description=_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--schedule", "-s", metavar="NAME", help="registered name (see `stagewise schedules`)")
    which.add_argument(
        "--from-torch", metavar="CLASS", help="a torch.distributed.pipelining schedule class, e.g. ZBVZeroBubble"
    )
    # required as a group with the hidden --stages alias (the old spelling: it always meant ranks, not stages;
    # accepted for one release, not advertised): the usage line shows --ranks P as required, as it is
    ranks = parser.add_mutually_exclusive_group(required=True)
    ranks.add_argument("--ranks", "-p", type=int, metavar="P", help="number of ranks P (pipeline degree)")
    ranks.add_argument("--stages", type=int, dest="ranks", help=argparse.SUPPRESS)
    parser.add_argument("--microbatches", "-m", type=int, required=True, metavar="M", help="micro-batches per step")
    parser.add_argument(
        "--virtual-stages",
        "-v",
        type=int,
        default=None,
        metavar="V",
        help="stages per rank (default: the schedule's own)",
    )
    add_times(parser)
    add_torch_flags(parser)
    add_torchtitan_check(parser)
    parser.add_argument("--png", metavar="PATH", help="write a Gantt chart PNG")
    parser.add_argument("--trace", metavar="PATH", help="write a Chrome/Perfetto trace JSON")
    parser.add_argument("--ascii", action="store_true", help="print a text chart")
    parser.add_argument("--width", type=int, default=120, metavar="N", help="width of the text chart (default 120)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a summary")
    parser.set_defaults(handler=run_simulate)


def check_arguments(args: argparse.Namespace) -> None:
    if args.ranks < 1:
        raise UsageError(f"--ranks must be >= 1, got {args.ranks}")
    if args.microbatches < 1:
        raise UsageError(f"--microbatches must be >= 1, got {args.microbatches}")
    if args.virtual_stages is not None and args.virtual_stages < 1:
        raise UsageError(f"--virtual-stages must be >= 1, got {args.virtual_stages}")
    check_times(args)
    if args.width < 10:
        raise UsageError(f"--width must be >= 10, got {args.width}")


def run_simulate(args: argparse.Namespace) -> int:
    from .. import build_schedule
    from .._util import gc_paused
    from ..simulation import simulate

    check_arguments(args)
    # one short-lived process making millions of acyclic objects: no collector passes over them, and they
    # are dropped before the pause ends (re-enabled with them alive, the next allocation would scan them all)
    with gc_paused():
        if args.from_torch:
            schedule = torch_schedule(args)
            problems = file_problems(args, schedule) if is_file(args.from_torch) else []
            if problems:
                for problem in problems:
                    print(f"stagewise simulate: {args.from_torch}: {problem}", file=sys.stderr)
                return 1
        else:
            schedule = build_schedule(args.schedule, args.ranks, args.microbatches, args.virtual_stages)
        result = simulate(schedule, _costs(args, schedule))
        if args.torch_csv:
            write_torch_csv(schedule, args.torch_csv, args.torch_format)
        # asynchronous schedules: labels "3v1" (for what draws the timeline) and versions kept
        versions = _async_versions(schedule, result, label=bool(args.png or args.trace or not args.json))
        if args.png:
            from ..render import render_png

            render_png(result.timeline, args.png)
        if args.trace:
            from ..render import render_trace

            render_trace(result.timeline, args.trace)
        if args.json:
            print(json.dumps(_report(args, schedule, result, versions)))
        else:
            _print_summary(args, schedule, result)
        del schedule, result, versions
    return 0


def _costs(args: argparse.Namespace, schedule: Schedule) -> CostModel:
    """The cost model: ``--costs`` (checked against the schedule's stage count) or uniform per-rank times."""
    v = schedule.virtual_stages
    what = f"{_label(args, schedule)} with {args.ranks} ranks and {v} stages per rank"
    return cost_model(args, schedule.num_stages, v, what)


def _label(args: argparse.Namespace, schedule: Schedule) -> str:
    return str(args.schedule) if args.schedule else schedule.name


def _report(
    args: argparse.Namespace, schedule: Schedule, result: SimResult, versions: dict[str, object]
) -> dict[str, object]:
    """What ``simulate --json`` prints."""
    times: dict[str, object] = {
        "f_time": args.f_time,
        "i_time": args.i_time,
        "b_time": args.i_time + args.w_time,  # the full backward B = I + W, what a schedule without split runs
        "w_time": args.w_time,
        "comm_time": args.comm_time,
        "sync_time": args.sync_time,
    }
    return {
        "schedule": _label(args, schedule),
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


def _print_summary(args: argparse.Namespace, schedule: Schedule, result: SimResult) -> None:
    v = schedule.virtual_stages
    stages = f"{v} stage{'s' if v > 1 else ''} per rank"
    times = (
        f"costs from {args.costs}"
        if args.costs
        else f"F={args.f_time:g} I={args.i_time:g} W={args.w_time:g} comm={args.comm_time:g} per rank"
    )
    label, m = _label(args, schedule), schedule.num_microbatches
    print(f"{label}: {schedule.num_ranks} ranks, {stages}, {m} micro-batches ({times})")
    print(f"  makespan   {result.makespan:g}")
    print(f"  bubble     {result.bubble_ratio:.1%}")
    print(f"  peak activations (micro-batches) per rank: {_short_list(result.peak_activations)}")
    for line in _notes(args, schedule):
        print(f"  {line}")
    for flag, path in (("png", args.png), ("trace", args.trace), (f"torch {args.torch_format} CSV", args.torch_csv)):
        if path:
            print(f"  wrote {flag}: {path}")
    if args.ascii:
        from ..render import render_ascii

        print()
        print(render_ascii(result.timeline, width=args.width))


def _notes(args: argparse.Namespace, schedule: Schedule) -> list[str]:
    """Why the numbers may differ from elsewhere: per-rank times split over the stages (``sw.simulate``'s default
    charges each stage 1), torch's FSDP actions set aside; and, for a file, what torchtitan needs to load it."""
    notes = []
    v = schedule.virtual_stages
    if v > 1 and not args.costs:
        notes.append(
            f"times are per rank: each of its {v} stages takes 1/{v} of them (sw.simulate(schedule) without "
            "costs charges every stage F = I = W = 1)"
        )
    fsdp = schedule.meta.get("torch_annotations")
    if isinstance(fsdp, tuple) and fsdp:
        notes.append(
            f"torch's FSDP actions (UNSHARD, RESHARD): {len(fsdp)} set aside in schedule.meta['torch_annotations'], "
            "not simulated"
        )
    if args.from_torch and is_file(args.from_torch):
        if args.torchtitan:
            notes.append(f"torchtitan: {args.torchtitan} with num_pp_microbatches {args.microbatches} loads it as is")
        else:
            notes.extend(torchtitan_lines(schedule, args.from_torch))
    elif args.torch_csv and args.torch_format == "compute_only":  # the file written: what loads it in torchtitan
        notes.extend(torchtitan_lines(schedule, args.torch_csv))
    return notes


def _short_list(values: Sequence[float], limit: int = 16) -> str:
    shown = " ".join(f"{x:g}" for x in values[:limit])
    return shown + (f" ... ({len(values)} ranks)" if len(values) > limit else "")


def _async_versions(schedule: Schedule, result: SimResult, *, label: bool = True) -> dict[str, object]:
    """For an asynchronous schedule: label the timeline's boxes with their versions (when it will be drawn),
    report the versions kept (only the peaks: the full memory report costs seconds at 128 x 1024)."""
    from ..schedules import is_asynchronous
    from ..simulation import labelled_timeline, peak_versions

    if not is_asynchronous(schedule):
        return {}
    if label:
        labelled_timeline(schedule, result)
    return {"peak_weight_versions": peak_versions(schedule)}
