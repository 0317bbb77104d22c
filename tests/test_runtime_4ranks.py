"""The runtime on 4 gloo ranks: every schedule against the one-process model, and pipelines on subgroups.

One torchrun job runs every check (tests/workers/runtime_checks.py) in one
process group; each test below asserts one check's result on every rank.
"""

from __future__ import annotations

import pytest

from _mp import parity_checks, run_suite, selected

RANKS = 4
PARITY = list(parity_checks(RANKS))


@pytest.fixture(scope="module")
def results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    return run_suite(
        "runtime_checks",
        RANKS,
        tmp_path_factory.mktemp("runtime4"),
        timeout=270,
        suite="parity+subgroups",
        only=selected(request),
    )


@pytest.mark.parametrize("name", PARITY)
def test_parity(results, name: str) -> None:
    results.assert_ok(name)


def test_pipelines_on_subgroups(results) -> None:
    """Groups {0, 2} and {1, 3}: group ranks are not global ranks, and the group is not WORLD."""
    results.assert_ok("subgroups")
