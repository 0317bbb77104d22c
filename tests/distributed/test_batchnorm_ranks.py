"""BatchNorm under micro-batching (issue 18) on 2 and 4 gloo ranks: deferred running statistics against the
one-process model under every synchronous schedule (a subset at 4 ranks), with and without recompute; the
detection message once; one torchrun job per rank count runs tests/distributed/workers/batchnorm_checks.py."""

from __future__ import annotations

import pytest

from batchnorm_checks import checks
from helpers.torchrun import SuiteResults, suites_by_ranks

CASES = [(ranks, name) for ranks in (2, 4) for name in checks(ranks)]
MESSAGE = "stagewise: the pipeline holds BatchNorm layers"

suites = suites_by_ranks("batchnorm_checks", "batchnorm", timeout=300)


@pytest.mark.parametrize(("ranks", "name"), CASES, ids=[f"{r}ranks-{n}" for r, n in CASES])
def test_batchnorm(suites, ranks: int, name: str) -> None:
    results: SuiteResults = suites(ranks)
    results.assert_ok(name)


@pytest.mark.parametrize("ranks", [2, 4])
def test_detection_message_appears_once(suites, ranks: int) -> None:
    """Two pipelines without batchnorm=, BatchNorm on the last rank only: rank 0 says it once, naming the stage."""
    results: SuiteResults = suites(ranks)
    results.assert_ok("detect")
    assert results.log.count(MESSAGE) == 1, results.log[-4000:]
    line = next(s for s in results.log.splitlines() if MESSAGE in s)
    assert f"stage {ranks - 1}: 1 BatchNorm1d" in line
