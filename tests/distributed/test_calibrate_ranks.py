"""sw.calibrate() on 2 gloo ranks: links, the cost per action and FSDP2's cost, and a plan that uses them."""

from __future__ import annotations

import pytest

import calibrate_checks
from helpers.torchrun import SuiteResults, run_suite

RANKS = 2


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> SuiteResults:
    return run_suite("calibrate_checks", RANKS, tmp_path_factory.mktemp("calibrate2"), timeout=240)


@pytest.mark.parametrize("name", list(calibrate_checks.checks(RANKS)))
def test_calibration_is_measured_and_used(results: SuiteResults, name: str) -> None:
    rows = results.get(name)
    assert len({str(row["info"]) for row in rows.values()}) == 1  # every rank got the same numbers
