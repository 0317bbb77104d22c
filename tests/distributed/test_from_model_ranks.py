"""``Pipeline.from_model`` and profile-based partitions on 2 and 4 gloo ranks: the shared 2- and 4-rank jobs
run every check of tests/distributed/workers/from_model_checks.py; each test asserts one check on every rank."""

from __future__ import annotations

import pytest

from from_model_checks import checks
from helpers.torchrun import Share, suites_by_ranks

CASES = [(2, name) for name in checks(2)] + [(4, name) for name in checks(4)]

SHARE = tuple(Share("from_model_checks", tuple(checks(r)), 420, ranks=r) for r in (2, 4))  # in the shared jobs
suites = suites_by_ranks("from_model_checks", "from_model", timeout=420, shared=SHARE)


@pytest.mark.parametrize(("ranks", "name"), CASES, ids=[f"{r}ranks-{n}" for r, n in CASES])
def test_check(suites, ranks: int, name: str) -> None:
    suites(ranks).get(name)
