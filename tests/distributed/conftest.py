"""tests/distributed: one torchrun job per module (helpers.torchrun), its checks in workers/; marked ``distributed``."""

from __future__ import annotations

import pytest


def pytest_itemcollected(item: pytest.Item) -> None:
    item.add_marker(pytest.mark.distributed)
