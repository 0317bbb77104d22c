"""``snapshot=`` on 4 gloo ranks (one torchrun job, tests/distributed/workers/snapshot_checks.py): a resume from
the peers' snapshots is bit-exact at the same layout, exact by name at another, works from a peer machine's
copies alone, refuses a damaged file and takes the generation before, loses to a newer checkpoint on disk;
the optimizer step waits for the copy; a clean exit removes the snapshots; what cannot be snapshotted is
refused on every rank."""

from __future__ import annotations

import pytest

from helpers.torchrun import SuiteResults, run_suite, selected
from snapshot_checks import checks

NAMES = list(checks(4))


@pytest.fixture(scope="module")
def results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> SuiteResults:
    out = tmp_path_factory.mktemp("snapshots")
    env = {"STAGEWISE_SNAPSHOT_TEST_DIR": str(tmp_path_factory.mktemp("shm")), "PYTHONWARNINGS": "ignore"}
    return run_suite("snapshot_checks", 4, out, timeout=300, env=env, only=selected(request))


@pytest.mark.parametrize("name", NAMES)
def test_check(results: SuiteResults, name: str) -> None:
    results.assert_ok(name)
