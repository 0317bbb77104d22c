"""What every command module shares: the error for a bad command line, and the type of the subcommand table."""

from __future__ import annotations

import argparse
from typing import TypeAlias

#: what ``add_command(sub)`` receives: argparse's table of subcommands
Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


class UsageError(Exception):
    """A bad command line: reported on one line, exit status 2."""
