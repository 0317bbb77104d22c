"""HetPipe (issue 12): wave-synchronous parallel over virtual workers on 4 gloo ranks equals its one-process
replay to 1e-12 in float64 (D = 0, 1, 2; equal and unequal stage counts), D = 0 is synchronous data parallelism,
mutants differ or are stopped by the run-time staleness check; the checks of
tests/distributed/workers/hetpipe_checks.py run in the shared 4-rank job (helpers.torchrun.shared_job)."""

from __future__ import annotations

import pytest

from helpers.torchrun import Share, SuiteResults, shared_job
from hetpipe_checks import checks

NAMES = list(checks(4))
#: in the shared 4-rank job, last: its last check (mutant-early-pull) leaves a failed board behind
SHARE = Share("hetpipe_checks", tuple(NAMES), timeout=300, last=True)
suite = shared_job(SHARE)


@pytest.mark.parametrize("name", NAMES)
def test_hetpipe(suite: SuiteResults, name: str) -> None:
    suite.assert_ok(name)
    for rank, row in sorted(suite.by_check[name].items()):
        if row["info"]:
            print(f"{name} rank {rank}: {row['info']}")
