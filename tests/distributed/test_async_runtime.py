"""Asynchronous pipelines (issue 11) on 2 and 4 gloo ranks: every async schedule equals the one-process
reference to 1e-12 in float64 (losses and parameters), mutants differ, bad options are refused: the checks of
tests/distributed/workers/async_checks.py in the shared 2-rank job and a 4-rank job of their own."""

from __future__ import annotations

import pytest

from async_checks import checks
from helpers.torchrun import Share, SuiteResults, suites_by_ranks

CASES = [(ranks, name) for ranks in (2, 4) for name in checks(ranks)]

#: 2 ranks in the shared 2-rank job, its failing check last; 4 ranks alone (the shared 4-rank job ends with hetpipe's
#: failed board already)
SHARE = (Share("async_checks", tuple(checks(2)), 400, ranks=2, last=("bad-data-fails-everywhere",)),)
suites = suites_by_ranks("async_checks", "async", timeout=400, shared=SHARE)


@pytest.mark.parametrize(("ranks", "name"), CASES, ids=[f"{r}ranks-{n}" for r, n in CASES])
def test_async(suites, ranks: int, name: str) -> None:
    results: SuiteResults = suites(ranks)
    results.assert_ok(name)
    for rank, row in sorted(results.by_check[name].items()):
        if row["info"]:
            print(f"{name} rank {rank}: {row['info']}")
