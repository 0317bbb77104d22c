"""HetPipe (issue 12): wave-synchronous parallel over virtual workers on 4 gloo ranks equals its one-process
replay to 1e-12 in float64 (D = 0, 1, 2; equal and unequal stage counts), D = 0 is synchronous data parallelism,
mutants differ or are stopped by the run-time staleness check; one torchrun job runs
tests/distributed/workers/hetpipe_checks.py."""

from __future__ import annotations

import pytest

from helpers.torchrun import SuiteResults, run_suite, selected
from hetpipe_checks import checks

NAMES = list(checks(4))


@pytest.fixture(scope="module")
def suite(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> SuiteResults:
    out = tmp_path_factory.mktemp("hetpipe")
    return run_suite("hetpipe_checks", 4, out, timeout=300, only=selected(request))


@pytest.mark.parametrize("name", NAMES)
def test_hetpipe(suite: SuiteResults, name: str) -> None:
    suite.assert_ok(name)
    for rank, row in sorted(suite.by_check[name].items()):
        if row["info"]:
            print(f"{name} rank {rank}: {row['info']}")
