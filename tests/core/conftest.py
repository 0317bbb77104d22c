"""tests/core: the pure core (schedules, passes, validator, simulator, planner, renderers), marked ``core``.

The core must not need torch, so a test here that loads it fails: a module that loads torch on import fails
its collection, and a test (or its fixtures) that loads torch while running fails. Each is judged only if
torch was not loaded before it; ``make test-core`` loads nothing else, and in the whole suite this folder is
collected first, so imports are always judged.
"""

from __future__ import annotations

import sys
from collections.abc import Generator
from typing import Any

import pytest

_TORCH_BEFORE = pytest.StashKey[bool]()


def _torch_loaded() -> bool:
    return "torch" in sys.modules


def pytest_itemcollected(item: pytest.Item) -> None:
    item.add_marker(pytest.mark.core)


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[None, Any, Any]:
    before = _torch_loaded()
    report = yield
    if isinstance(collector, pytest.Module) and not before and _torch_loaded():
        report.outcome = "failed"
        report.longrepr = (
            f"{collector.path.name} loads torch when imported (itself or through what it imports); "
            "tests/core is for the pure core: move a test that needs torch to tests/runtime"
        )
    return report


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    item.stash[_TORCH_BEFORE] = _torch_loaded()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, Any, Any]:
    result = yield
    if not item.stash.get(_TORCH_BEFORE, True) and _torch_loaded():
        pytest.fail(
            f"{item.nodeid} loaded torch while it ran; tests/core is for the pure core: "
            "move a test that needs torch to tests/runtime",
            pytrace=False,
        )
    return result
