"""Issue 5 part A on 2 gloo ranks: tied parameters, recompute, clipping, aux losses, frozen values, BatchNorm
and measured activation memory vs the simulator; one torchrun job runs tests/workers/feature_checks.py."""

from __future__ import annotations

import pytest
from feature_checks import checks  # noqa: E402

from _mp import SuiteResults, run_suite

RANKS = 2
NAMES = list(checks(RANKS))


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> SuiteResults:
    return run_suite("feature_checks", RANKS, tmp_path_factory.mktemp("features2"), timeout=240)


@pytest.mark.parametrize("name", NAMES)
def test_feature(results: SuiteResults, name: str) -> None:
    results.assert_ok(name)
    if name.startswith("memory-"):
        for rank, row in sorted(results.by_check[name].items()):
            print(f"{name} rank {rank}: {row['info']}")
