"""nan_policy on 2 gloo ranks (float64): tests/distributed/workers/nan_checks.py, in the shared 2-rank job."""

from __future__ import annotations

import pytest

from helpers.torchrun import Share, SuiteResults, shared_job
from nan_checks import checks

NAMES = list(checks(2))

SHARE = Share("nan_checks", tuple(NAMES), timeout=240, ranks=2)  # in the shared 2-rank job
results = shared_job(SHARE)


@pytest.mark.parametrize("name", NAMES)
def test_nan_policy(results: SuiteResults, name: str) -> None:
    results.assert_ok(name)
