"""Asynchronous pipelines (issue 11) on 2 and 4 gloo ranks: every async schedule equals the one-process
reference to 1e-12 in float64 (losses and parameters), mutants differ, bad options are refused; one torchrun
job per rank count runs tests/distributed/workers/async_checks.py."""

from __future__ import annotations

import pytest

from async_checks import checks
from helpers.torchrun import SuiteResults, suites_by_ranks

CASES = [(ranks, name) for ranks in (2, 4) for name in checks(ranks)]

suites = suites_by_ranks("async_checks", "async", timeout=400)


@pytest.mark.parametrize(("ranks", "name"), CASES, ids=[f"{r}ranks-{n}" for r, n in CASES])
def test_async(suites, ranks: int, name: str) -> None:
    results: SuiteResults = suites(ranks)
    results.assert_ok(name)
    for rank, row in sorted(results.by_check[name].items()):
        if row["info"]:
            print(f"{name} rank {rank}: {row['info']}")
