"""Launching local ranks with torch's own launcher (``torch.distributed.run``), for ``stagewise run``."""

from __future__ import annotations

import sys


def torchrun(argv: list[str]) -> int:
    """Hand over to ``torch.distributed.run``; returns the exit status (1 when a child failed)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    try:
        torchrun_main(argv)
    except ChildFailedError as err:
        print(f"stagewise run: {err}", file=sys.stderr)
        return 1
    return 0
