"""Evaluation on 2 gloo ranks: tests/distributed/workers/eval_checks.py, one torchrun job (its last check leaves
a failed pipeline behind)."""

from __future__ import annotations

import pytest

from eval_checks import checks
from helpers.torchrun import SuiteResults, suites_by_ranks

NAMES = list(checks(2))

suites = suites_by_ranks("eval_checks", "eval", timeout=120)


@pytest.mark.parametrize("name", NAMES)
def test_eval(suites, name: str) -> None:
    results: SuiteResults = suites(2)
    rows = results.get(name)
    if name == "inference-mode":  # the transport whose buffers outlived the evaluation
        assert {row["info"]["transport"] for row in rows.values()} == {"ShmTransport"}, rows
    if name == "no-targets":  # every rank names the missing targets (waiting out the timeout said "waited 30.0 s")
        assert all("waited" not in row["info"]["said"] for row in rows.values()), rows
