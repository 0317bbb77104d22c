"""The sync audit on 4 gloo ranks (tests/distributed/workers/host_read_checks.py): each rank reads the device
once per step (the loss; with dp, the replicas' mean once more), and token counts kept on the device weight
the replicas' losses exactly as Python counts do."""

from __future__ import annotations

import pytest

from helpers.torchrun import SuiteResults, run_suite, selected
from host_read_checks import checks


@pytest.fixture(scope="module")
def results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> SuiteResults:
    return run_suite("host_read_checks", 4, tmp_path_factory.mktemp("reads"), timeout=240, only=selected(request))


@pytest.mark.parametrize("name", list(checks(4)))
def test_host_reads(results: SuiteResults, name: str) -> None:
    results.assert_ok(name)
