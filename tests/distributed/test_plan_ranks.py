"""Plans the planner picks, run on 4 gloo ranks against the one-process model; sw.plan gives every rank the
same plans, and ranks holding different plans are refused.

The checks are in tests/distributed/workers/plan_checks.py.
"""

from __future__ import annotations

import pytest

import plan_checks
from helpers.torchrun import Share, SuiteResults, shared_job

RANKS = 4
CHECKS = [*plan_checks.chosen(RANKS), "on_mesh", "agreed", "different_plans"]
SHARE = Share("plan_checks", tuple(CHECKS), timeout=240)  # in the shared 4-rank job
results = shared_job(SHARE)


def test_the_plans_cover_pipelines_sharding_and_virtual_stages() -> None:
    assert {"best", "deepest", "sharded", "virtual", "recompute"} <= set(CHECKS)


@pytest.mark.parametrize("name", CHECKS)
def test_plan_runs_like_one_process(results: SuiteResults, name: str) -> None:
    results.assert_ok(name)
