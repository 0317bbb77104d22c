"""4-D hybrid parallelism on 8 gloo ranks: several layouts of the same processes against the one-process model.

One torchrun job runs every check of tests/distributed/workers/hybrid_checks.py (each
builds its own mesh); each test below asserts one check on every rank. Then
the optimizer state each rank measured is compared across layouts: sharding
over ``s`` ranks leaves each ``~1/s`` of it.

``make hybrid`` runs it (``STAGEWISE_HYBRID8=1``): eight interpreters on two cores take 65-75 s of CI's time, and
the layouts of two axes run in ``make test`` at 4 ranks (the combination matrix's dp and sharding columns, the
checkpoints' pp x tp and pp x sharding, ``from_hf``'s pp x dp, x sharding and x tp).
"""

from __future__ import annotations

import os

import pytest

import hybrid_checks as hc
from helpers.torchrun import SuiteResults, run_suite, selected

RANKS = 8
CHECKS = list(hc.layouts8())

pytestmark = pytest.mark.skipif(not os.environ.get("STAGEWISE_HYBRID8"), reason="8 ranks of 4-D layouts: `make hybrid`")


@pytest.fixture(scope="module")
def results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> SuiteResults:
    return run_suite(
        "hybrid_checks",
        RANKS,
        tmp_path_factory.mktemp("hybrid8"),
        timeout=240,
        suite="hybrid8",
        env={"PYTHONWARNINGS": "ignore"},
        only=selected(request),
    )


@pytest.mark.parametrize("name", CHECKS)
def test_check(results: SuiteResults, name: str) -> None:
    results.assert_ok(name)


def _measured(results: SuiteResults, name: str) -> list[dict]:
    results.assert_ok(name)
    return [results.by_check[name][r]["info"] for r in range(RANKS)]


def test_sharding_halves_the_optimizer_state_of_a_2x2x2_mesh(results: SuiteResults) -> None:
    """pp 2 x sharding 2 x tp 2 against pp 2 x dp 2 x tp 2: same stages and tp split, half the state each."""
    sharded = _measured(results, "pp2-sharding2-tp2-1f1b")
    replicated = _measured(results, "pp2-dp2-tp2-zb-h1")
    for pp in range(2):
        for tp in range(2):
            whole = [m["state_bytes"] for m in replicated if (m["coords"][0], m["coords"][3]) == (pp, tp)]
            parts = [m["state_bytes"] for m in sharded if (m["coords"][0], m["coords"][3]) == (pp, tp)]
            assert len(set(whole)) == 1 and len(parts) == 2
            assert sum(parts) == whole[0]  # the shards partition the state exactly
            assert max(parts) <= 0.55 * whole[0], (pp, tp, parts, whole)


def test_sharding_4_quarters_the_optimizer_state(results: SuiteResults) -> None:
    """dp 2 x sharding 4 on one stage: each rank holds ~1/4 of the whole model's AdamW state."""
    measured = _measured(results, "pp1-dp2-sharding4-gpipe")
    whole = measured[0]["ref_state_bytes"]
    for dp in range(2):
        parts = [m["state_bytes"] for m in measured if m["coords"][1] == dp]
        assert sum(parts) == whole
        assert max(parts) <= 0.3 * whole, (parts, whole)
