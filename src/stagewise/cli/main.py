"""The ``stagewise`` command: the parser, and the dispatch to one module per subcommand.

Each command module (:mod:`.schedules`, :mod:`.simulate`, :mod:`.synthesize`,
:mod:`.run`, :mod:`.rendezvous`, :mod:`.plan`, :mod:`.compare`) has ``add_command(subparsers)``, which defines
its arguments and the handler to call; :data:`COMMANDS` lists them, so a new
subcommand is one module and one entry. Handlers return the exit status.
Bad arguments, including values the library rejects with ``ValueError``, exit
with status 2 and a one-line reason on stderr; a schedule that fails
validation (a generator bug, not a bad argument) exits 1 with every problem.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from . import compare, plan, rendezvous, run, schedules, simulate, synthesize
from .common import UsageError

Handler = Callable[[argparse.Namespace], int]

#: one module per subcommand, in the order ``stagewise --help`` lists them
COMMANDS = (schedules, simulate, synthesize, run, rendezvous, plan, compare)


def version() -> str:
    """The installed distribution's version (what pip reports), else the source tree's (``stagewise._util.VERSION``)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("stagewise")
    except PackageNotFoundError:  # imported from a source tree that was never installed
        from .. import _util

        return _util.VERSION


class _Version(argparse.Action):
    """``--version``, looked up only when asked (the metadata lookup would slow every command's start)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, help="print the version and exit")

    def __call__(self, parser: argparse.ArgumentParser, *args: Any) -> None:
        print(f"stagewise {version()}")
        parser.exit(0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stagewise",
        description="Pipeline-parallel schedules: list them (schedules), simulate and draw one (simulate), run a "
        "training script on N processes (run), plan layout, schedule and partition (plan), compare the pipeline "
        "methods (compare).",
    )
    parser.add_argument("--version", action=_Version)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_command(sub)
    return parser


#: the options that name a file a command writes (plan --json, simulate --png, synthesize --csv ...)
WRITTEN = ("png", "trace", "csv", "json", "torch_csv")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``stagewise`` command line; returns the exit status (2 for bad arguments)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse has printed its usage message (or --help, --version)
        return int(exit_.code or 0)
    from ..validate import ScheduleError

    handler: Handler = args.handler
    try:
        for name in WRITTEN:  # a file the command writes goes where it is asked: its folder made, as a user expects
            value = getattr(args, name, None)
            if isinstance(value, str):
                try:
                    Path(value).parent.mkdir(parents=True, exist_ok=True)
                except OSError as err:
                    why = f"{err.filename} is a file" if isinstance(err, (FileExistsError, NotADirectoryError)) else err
                    raise UsageError(f"--{name.replace('_', '-')} {value}: cannot make its folder ({why})") from None
        return handler(args)
    except OSError as err:
        print(f"stagewise {args.command}: error: {err}", file=sys.stderr)
        return 1
    except ScheduleError as err:  # a generator bug, not a bad argument: show every problem
        print(f"stagewise {args.command}: {err}", file=sys.stderr)
        return 1
    except (UsageError, ValueError) as err:
        reason = " ".join(str(err).split("\n")[0].split())
        print(f"stagewise {args.command}: error: {reason}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
