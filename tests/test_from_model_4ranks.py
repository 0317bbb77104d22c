"""``Pipeline.from_model`` and profile-based partitions on 4 gloo ranks: one torchrun job runs every check of
tests/workers/from_model_checks.py; each test asserts one check on every rank."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "workers"))
from from_model_checks import Results, checks, launch  # noqa: E402

RANKS = 4
NAMES = list(checks(RANKS))


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Results:
    return launch(RANKS, tmp_path_factory.mktemp("from_model4"), timeout=420)


@pytest.mark.parametrize("name", NAMES)
def test_check(results: Results, name: str) -> None:
    results.get(name)
