"""Synthesized schedules (issue 35) on 2 and 4 gloo ranks: float64 parity with the one-process model, as
every registered schedule has it; the shared 2- and 4-rank jobs run
tests/distributed/workers/synthesize_checks.py."""

from __future__ import annotations

import pytest

from helpers.torchrun import Share, SuiteResults, suites_by_ranks
from synthesize_checks import auto, checks, registered_twin

CASES = [(ranks, name) for ranks in (2, 4) for name in checks(ranks)]

SHARE = tuple(Share("synthesize_checks", tuple(checks(r)), 300, ranks=r) for r in (2, 4))  # in the shared jobs
suites = suites_by_ranks("synthesize_checks", "synthesize", timeout=300, shared=SHARE)


def test_the_checks_run_orders_of_their_own() -> None:
    """No registered schedule has the compute order of the checks' synthesized schedules."""
    for p in (2, 4):
        own = (auto(p, 2 * p + 1), auto(p, p + 1), auto(p, p + 1, v=2), auto(p, p + 1, v=2, factor=2))
        for schedule in (*own, auto(p, p, v=2, placement="loop")):
            assert registered_twin(schedule) is None, (p, schedule.to_text())


@pytest.mark.parametrize(("ranks", "name"), CASES, ids=[f"{r}ranks-{n}" for r, n in CASES])
def test_synthesized_parity(suites, ranks: int, name: str) -> None:
    results: SuiteResults = suites(ranks)
    results.assert_ok(name)
