"""Parameter attributes under sharding and tp on 2 gloo ranks: tests/distributed/workers/marks_checks.py, in the
shared 2-rank job."""

from __future__ import annotations

import pytest

from helpers.torchrun import Share, SuiteResults, shared_job
from marks_checks import checks

NAMES = list(checks(2))

SHARE = Share("marks_checks", tuple(NAMES), timeout=120, ranks=2)  # in the shared 2-rank job
results = shared_job(SHARE)


@pytest.mark.parametrize("name", NAMES)
def test_marks(results: SuiteResults, name: str) -> None:
    results.assert_ok(name)
