"""``pipe.close()`` on 2 gloo ranks: tests/distributed/workers/close_checks.py, in the shared 2-rank job."""

from __future__ import annotations

import pytest

from close_checks import checks
from helpers.torchrun import Share, SuiteResults, shared_job

NAMES = list(checks(2))

SHARE = Share("close_checks", tuple(NAMES), timeout=120, ranks=2)  # in the shared 2-rank job
results = shared_job(SHARE)


@pytest.mark.parametrize("name", NAMES)
def test_close(results: SuiteResults, name: str) -> None:
    results.assert_ok(name)
