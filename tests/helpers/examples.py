"""How many examples a long property test of the core draws: all of them under ``make test-deep``
(``STAGEWISE_DEEP=1``), a quarter in ``make test``, whose budget on CI's two cores they would otherwise spend
(the fast-vs-reference agreement tests drew 150-600 each: a fifth of the core's time)."""

from __future__ import annotations

import os

DEEP = os.environ.get("STAGEWISE_DEEP") == "1"


def examples(full: int) -> int:
    """``full`` under ``make test-deep``; a quarter of it, at least 40, otherwise."""
    return full if DEEP else max(40, full // 4)
