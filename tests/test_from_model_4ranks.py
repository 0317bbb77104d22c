"""``Pipeline.from_model`` and profile-based partitions on 4 gloo ranks: one torchrun job runs every check of
tests/workers/from_model_checks.py; each test asserts one check on every rank."""

from __future__ import annotations

import pytest
from from_model_checks import checks

from _mp import SuiteResults, run_suite

RANKS = 4
NAMES = list(checks(RANKS))


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> SuiteResults:
    return run_suite("from_model_checks", RANKS, tmp_path_factory.mktemp("from_model4"), timeout=420)


@pytest.mark.parametrize("name", NAMES)
def test_check(results: SuiteResults, name: str) -> None:
    results.get(name)
