"""``stagewise synthesize``: the fastest schedule found for given costs, reported, drawn and written out.

The schedule can be written as stagewise's CSV (``--csv``, read back by ``Schedule.load_csv``) and as the
CSV torch's ``_PipelineScheduleRuntime`` loads (``--torch-csv``), which is the file torchtitan's schedule
CSV option takes. Bad arguments raise :class:`~.common.UsageError` (exit 2).
"""

from __future__ import annotations

import argparse
import json

from .common import Subparsers, UsageError
from .costs import add_times, check_times, cost_model
from .torch_files import add_torch_csv, torchtitan_lines, write_torch_csv

_HELP = """\
Synthesize a schedule for your costs (stagewise.synthesize): the hand-written
schedules that fit the memory cap, improved by a deterministic search, never
slower in simulation than the best of them. Prints its makespan, the lower
bound and the baseline it started from.

Costs are per micro-batch and per rank as in `stagewise simulate` (--f-time,
--i-time, --w-time, --comm-time), or per stage from --costs FILE (a
CostModel.to_dict JSON, e.g. from sw.profile(...).cost_model(...)).

--torch-csv FILE writes the schedule for torch.distributed.pipelining: load it
with _PipelineScheduleRuntime._load_csv(FILE, format) or torchtitan's schedule
CSV option, with the stages placed as the file's rows say (row r, rank r). The
torchtitan settings that load it are printed (the schedule class that places
its stages, the micro-batch count); `stagewise simulate --from-torch FILE.csv
--torchtitan CLASS -p P -m M` checks a file against a job's settings.
"""


def add_command(sub: Subparsers) -> None:
    parser = sub.add_parser(
        "synthesize",
        help="synthesize a schedule for given costs; write it for stagewise or torch",
        description=_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--ranks", "-p", type=int, required=True, metavar="P", help="number of ranks P")
    parser.add_argument("--microbatches", "-m", type=int, required=True, metavar="M", help="micro-batches per step")
    parser.add_argument("--virtual-stages", "-v", type=int, default=1, metavar="V", help="stages per rank (default 1)")
    parser.add_argument(
        "--placement", choices=("loop", "v"), default=None, help="where stages go (default: v for V = 2, else loop)"
    )
    parser.add_argument(
        "--memory", type=float, default=None, metavar="N", help="activation cap per rank, in micro-batches"
    )
    parser.add_argument(
        "--effort",
        type=int,
        default=None,
        metavar="N",
        help="evaluations of the local search (default by size; 0: none)",
    )
    add_times(parser)
    parser.add_argument("--csv", metavar="PATH", help="write the schedule as stagewise's CSV")
    add_torch_csv(parser)
    parser.add_argument("--png", metavar="PATH", help="write a Gantt chart PNG of its simulation")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a summary")
    parser.set_defaults(handler=run_synthesize)


def run_synthesize(args: argparse.Namespace) -> int:
    from ..simulation import simulate
    from ..synthesis import synthesize

    for flag in ("ranks", "microbatches", "virtual_stages"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.effort is not None and args.effort < 0:
        raise UsageError(f"--effort must be >= 0 (0: no local search), got {args.effort}")
    check_times(args)
    p, m, v = args.ranks, args.microbatches, args.virtual_stages
    costs = cost_model(args, p * v, v, f"{p} ranks with {v} stages per rank")
    schedule = synthesize(
        costs, p, m, memory=args.memory, virtual_stages=v, placement=args.placement, effort=args.effort
    )
    written, notes = [], []
    if args.csv:
        _write(args.csv, "--csv", schedule.to_csv())
        written.append(("stagewise CSV", args.csv))
    if args.torch_csv:
        write_torch_csv(schedule, args.torch_csv, args.torch_format)
        written.append((f"torch {args.torch_format} CSV", args.torch_csv))
        notes = torchtitan_lines(schedule, args.torch_csv)
        if args.torch_format == "compute_comms":
            notes = ["torchtitan: loads compute_only files only (write one with --torch-format compute_only)"]
    if args.png:
        from ..render import render_png

        render_png(simulate(schedule, costs).timeline, args.png)
        written.append(("png", args.png))
    report = dict(schedule.meta.get("synthesis", {}))  # type: ignore[call-overload]
    if args.json:
        print(json.dumps({"ranks": p, "microbatches": m, "virtual_stages": v, **report}))
        return 0
    print(f"synthesized: {p} ranks, {v} stage{'s' if v > 1 else ''} per rank, {m} micro-batches")
    print(f"  makespan   {report['makespan']:g} (lower bound {report['lower_bound']:g}, gap {report['gap']:.1%})")
    print(f"  baseline   {report['baseline']} {report['baseline_makespan']:g}")
    for what, path in written:
        print(f"  wrote {what}: {path}")
    for line in notes:
        print(f"  {line}")
    return 0


def _write(path: str, flag: str, text: str) -> None:
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError as err:
        raise UsageError(f"{flag} {path}: {err}") from None
