"""nan_policy on 2 gloo ranks (float64): tests/distributed/workers/nan_checks.py in one torchrun job."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.torchrun import SuiteResults, run_suite
from nan_checks import checks

NAMES = list(checks(2))


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> SuiteResults:
    out: Path = tmp_path_factory.mktemp("nan")
    return run_suite("nan_checks", 2, out, timeout=240)


@pytest.mark.parametrize("name", NAMES)
def test_nan_policy(results: SuiteResults, name: str) -> None:
    results.assert_ok(name)
