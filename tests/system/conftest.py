"""tests/system: whole programs in subprocesses (examples, the README, restarts, faults, two machines); marked
``system``. The programs the tests start, and the harness that judges the fault matrix, are in scripts/."""

from __future__ import annotations

import pytest


def pytest_itemcollected(item: pytest.Item) -> None:
    item.add_marker(pytest.mark.system)
