"""tests/distributed: one torchrun job per module (helpers.torchrun), its checks in workers/; marked ``distributed``.

A module that declares a ``SHARE`` runs its checks in the job of its rank count that it shares with the others that
do (``helpers.torchrun.shared_job``, ``suites_by_ranks``): its tests get the longest shared job's timeout, since the
first of them waits for it all.
"""

from __future__ import annotations

import pytest

from helpers.torchrun import shared_timeout, shares_of


def pytest_itemcollected(item: pytest.Item) -> None:
    item.add_marker(pytest.mark.distributed)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    modules = [getattr(item, "module", None) for item in items]
    timeout = shared_timeout(modules)
    for item, module in zip(items, modules, strict=True):
        if shares_of(module):
            item.add_marker(pytest.mark.timeout(timeout))
