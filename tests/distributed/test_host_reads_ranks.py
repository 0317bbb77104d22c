"""The sync audit on 4 gloo ranks (tests/distributed/workers/host_read_checks.py): each rank reads the device
once per step (the loss; with dp, the replicas' mean once more), and token counts kept on the device weight
the replicas' losses exactly as Python counts do."""

from __future__ import annotations

import pytest

from helpers.torchrun import Share, SuiteResults, shared_job
from host_read_checks import checks

SHARE = Share("host_read_checks", tuple(checks(4)), timeout=240)  # in the shared 4-rank job
results = shared_job(SHARE)


@pytest.mark.parametrize("name", list(checks(4)))
def test_host_reads(results: SuiteResults, name: str) -> None:
    results.assert_ok(name)
