"""Evaluation on 2 gloo ranks: tests/distributed/workers/eval_checks.py, in the shared 2-rank job."""

from __future__ import annotations

import pytest

from eval_checks import checks
from helpers.torchrun import Share, SuiteResults, shared_job

NAMES = list(checks(2))

SHARE = Share("eval_checks", tuple(NAMES), timeout=120, ranks=2)  # in the shared 2-rank job
results = shared_job(SHARE)


@pytest.mark.parametrize("name", NAMES)
def test_eval(results: SuiteResults, name: str) -> None:
    rows = results.get(name)
    if name == "inference-mode":  # the transport whose buffers outlived the evaluation
        assert {row["info"]["transport"] for row in rows.values()} == {"ShmTransport"}, rows
