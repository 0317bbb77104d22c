"""sw.calibrate() on 2 gloo ranks: links, the cost per action and FSDP2's cost, and a plan that uses them; the checks of
tests/distributed/workers/calibrate_checks.py in the shared 2-rank job (helpers.torchrun.shared_job)."""

from __future__ import annotations

import pytest

import calibrate_checks
from helpers.torchrun import Share, SuiteResults, shared_job

RANKS = 2

SHARE = Share("calibrate_checks", tuple(calibrate_checks.checks(RANKS)), timeout=240, ranks=RANKS)
results = shared_job(SHARE)


@pytest.mark.parametrize("name", list(calibrate_checks.checks(RANKS)))
def test_calibration_is_measured_and_used(results: SuiteResults, name: str) -> None:
    rows = results.get(name)
    assert len({str(row["info"]) for row in rows.values()}) == 1  # every rank got the same numbers
