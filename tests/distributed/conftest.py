"""tests/distributed: one torchrun job per module (helpers.torchrun), its checks in workers/; marked ``distributed``.

A module that declares a ``SHARE`` runs its checks in the job it shares with the others that do
(``helpers.torchrun.shared_job``): its tests get the shared job's timeout, since the first of them waits for it all.
"""

from __future__ import annotations

import pytest

from helpers.torchrun import SHARED_TEST_TIMEOUT, Share


def pytest_itemcollected(item: pytest.Item) -> None:
    item.add_marker(pytest.mark.distributed)
    if isinstance(getattr(getattr(item, "module", None), "SHARE", None), Share):
        item.add_marker(pytest.mark.timeout(SHARED_TEST_TIMEOUT))
