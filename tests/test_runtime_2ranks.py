"""The runtime on 2 gloo ranks: every schedule against the one-process model, and the features.

One torchrun job runs every check (tests/workers/runtime_checks.py) in one
process group; each test below asserts one check's result on every rank.
"""

from __future__ import annotations

import pytest

from _mp import feature_checks, parity_checks, run_suite, selected

RANKS = 2
PARITY = list(parity_checks(RANKS))
FEATURES = list(feature_checks(RANKS))


@pytest.fixture(scope="module")
def results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    return run_suite(
        "runtime_checks",
        RANKS,
        tmp_path_factory.mktemp("runtime2"),
        timeout=240,
        suite="parity+features",
        only=selected(request),
    )


@pytest.mark.parametrize("name", PARITY)
def test_parity(results, name: str) -> None:
    results.assert_ok(name)


@pytest.mark.parametrize("name", FEATURES)
def test_feature(results, name: str) -> None:
    results.assert_ok(name)
