"""``snapshot=`` on 4 gloo ranks (tests/distributed/workers/snapshot_checks.py, in the shared 4-rank job): a resume from
the peers' snapshots is bit-exact at the same layout, exact by name at another, works from a peer machine's
copies alone, refuses a damaged file and takes the generation before, loses to a newer checkpoint on disk;
the optimizer step waits for the copy; a clean exit removes the snapshots; what cannot be snapshotted is
refused on every rank."""

from __future__ import annotations

import pytest

from helpers.torchrun import Share, SuiteResults, shared_job
from snapshot_checks import checks

NAMES = list(checks(4))


def _env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return {"STAGEWISE_SNAPSHOT_TEST_DIR": str(tmp_path_factory.mktemp("shm")), "PYTHONWARNINGS": "ignore"}


SHARE = Share("snapshot_checks", tuple(NAMES), timeout=300, env=_env)  # in the shared 4-rank job
results = shared_job(SHARE)


@pytest.mark.parametrize("name", NAMES)
def test_check(results: SuiteResults, name: str) -> None:
    results.assert_ok(name)
