"""Gradient merge and reproducible dropout (issue 42) on 4 gloo ranks: one torchrun job runs
tests/distributed/workers/training_checks.py; each test asserts one check on every rank."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.torchrun import SuiteResults, run_suite, selected
from training_checks import checks

RANKS = 4


@pytest.fixture(scope="module")
def results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> SuiteResults:
    return run_suite(
        "training_checks", RANKS, Path(tmp_path_factory.mktemp("training")), timeout=300, only=selected(request)
    )


@pytest.mark.parametrize("name", list(checks(RANKS)))
def test_check(results: SuiteResults, name: str) -> None:
    results.get(name)
