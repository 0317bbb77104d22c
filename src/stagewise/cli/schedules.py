"""``stagewise schedules``: one line per registered schedule (its summary, bubble and stages per rank)."""

from __future__ import annotations

import argparse

from .common import Subparsers


def add_command(sub: Subparsers) -> None:
    parser = sub.add_parser("schedules", help="list the registered schedules", description="List the schedules.")
    parser.set_defaults(handler=run_schedules)


def run_schedules(args: argparse.Namespace) -> int:
    from ..schedules import schedule_info, schedule_names

    infos = [schedule_info(name) for name in schedule_names()]
    width = max((len(info.name) for info in infos), default=0)
    for info in infos:
        v = "v any" if info.virtual_stages is None else "v=" + "|".join(map(str, info.virtual_stages))
        print(f"{info.name:<{width}}  {info.summary}  [bubble {info.bubble}; {v}]")
    return 0
