"""Issue 5 part A on 2 and 4 gloo ranks: tied parameters, recompute, clipping, aux losses, frozen values,
BatchNorm and measured activation memory vs the simulator; at 4 ranks issue 42's gradient merge and
reproducible dropout; the shared 2- and 4-rank jobs run tests/distributed/workers/feature_checks.py."""

from __future__ import annotations

import pytest

from feature_checks import checks
from helpers.torchrun import Share, SuiteResults, suites_by_ranks

CASES = [(ranks, name) for ranks in (2, 4) for name in checks(ranks)]

SHARE = tuple(Share("feature_checks", tuple(checks(r)), 240, ranks=r) for r in (2, 4))  # in the shared jobs
suites = suites_by_ranks("feature_checks", "features", timeout=240, shared=SHARE)


@pytest.mark.parametrize(("ranks", "name"), CASES, ids=[f"{r}ranks-{n}" for r, n in CASES])
def test_feature(suites, ranks: int, name: str) -> None:
    results: SuiteResults = suites(ranks)
    results.assert_ok(name)
    if name.startswith("memory-"):
        for rank, row in sorted(results.by_check[name].items()):
            print(f"{name} rank {rank}: {row['info']}")
